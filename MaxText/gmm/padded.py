"""Capacity-padded batched GEMM: the fixed-capacity baseline.

Expects the layout of `moe_dispatch=capacity`: every group owns the same number
of consecutive rows (rows / groups), unused rows zero-filled, so the grouped
GEMM is one batched einsum. Its cost is that of the padded rows, whatever the
real group sizes.
"""

import jax
import jax.numpy as jnp

from MaxText.gmm.base import FunctionGemm


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  groups = w.shape[0]
  if x.shape[0] % groups:
    raise ValueError(
      f"moe_gmm_backend=padded needs rows ({x.shape[0]}) divisible by groups ({groups}): use moe_dispatch=capacity"
    )
  per_group = x.reshape(groups, x.shape[0] // groups, x.shape[1])
  y = jnp.einsum("gck,gkn->gcn", per_group, w, preferred_element_type=x.dtype)
  return y.reshape(x.shape[0], w.shape[2])


def build(entry, options) -> FunctionGemm:
  return FunctionGemm(entry.name, gmm)
