"""Grouped GEMM through jax.lax.ragged_dot: runs on any backend; the baseline."""

import jax

from MaxText.gmm import vjp
from MaxText.gmm.base import FunctionGemm


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)


def build(entry, options) -> FunctionGemm:
  # Differentiated by JAX; the three kernels are ragged_dot's own formulations (for mxfp8's emulation).
  return FunctionGemm(entry.name, gmm, (vjp.xla_fwd, vjp.xla_dgrad, vjp.xla_wgrad))
