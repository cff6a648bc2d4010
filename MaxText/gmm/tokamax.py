"""tokamax's ragged_dot (Pallas kernels with their own VJP), when tokamax is installed.

Imported only when this backend is chosen.
"""

import jax

from MaxText.gmm.base import FunctionGemm


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  import tokamax

  return tokamax.ragged_dot(x, w, group_sizes=group_sizes.astype("int32"))


def build(entry, options) -> FunctionGemm:
  return FunctionGemm(entry.name, gmm)
