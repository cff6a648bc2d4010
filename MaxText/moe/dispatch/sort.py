"""Dropless dispatch by sorting token copies by expert id (the reference path).

Each token's k copies are stably sorted by expert, so every expert's rows are
contiguous and a grouped GEMM can run over them; combine gathers each token's
rows back and sums them weighted in float32. The permutation and its gradients
are gathers under custom VJPs (`MaxText/moe/permute.py`): nothing is dropped,
no [tokens, experts] mask is built and no scatter runs, forward or backward.
With `moe_group_pad_multiple` each expert's rows are padded with zero rows to a
multiple of the GEMM's row tile.
"""

import jax
import jax.numpy as jnp

from MaxText.moe import permute
from MaxText.moe.dispatch import Dispatched


class SortDispatcher:
  def __init__(self, group_pad_multiple: int = 0):
    self.group_pad_multiple = group_pad_multiple

  def dispatch(self, x: jax.Array, expert_ids: jax.Array, num_experts: int) -> Dispatched:
    plan = permute.plan(expert_ids, num_experts, self.group_pad_multiple)
    rows = permute.permute(x, plan)
    return Dispatched(rows, plan.group_sizes, jnp.zeros((), jnp.int32), plan)

  def rows_of(self, a: jax.Array, dispatched: Dispatched) -> jax.Array:
    """Any per-token array [tokens, ...] laid out as dispatch laid out x (padding rows zero); no gradient."""
    plan = dispatched.context
    return permute.gather_rows(a, plan.row_copy // plan.dest.shape[1])

  def combine(self, y: jax.Array, weights: jax.Array, dispatched: Dispatched) -> jax.Array:
    return permute.unpermute(y, weights, dispatched.context)
