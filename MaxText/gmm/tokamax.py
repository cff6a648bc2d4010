"""tokamax's ragged_dot (Pallas kernels with their own VJP), when tokamax is installed.

Imported only when this backend is chosen.
"""

import sys

import jax

from MaxText.gmm.base import FunctionGemm


def _absl_flags_at_defaults() -> None:
  """tokamax reads its settings from absl flags and, when nobody has parsed them, parses sys.argv: a program's
  own options (e.g. a benchmark's --out) then stop it with UnrecognizedFlagError. Parse none: defaults."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  import tokamax

  _absl_flags_at_defaults()

  return tokamax.ragged_dot(x, w, group_sizes=group_sizes.astype("int32"))


def build(entry, options) -> FunctionGemm:
  return FunctionGemm(entry.name, gmm)
