"""Capacity-based dispatch: every expert gets a fixed buffer of C rows.

C = ceil(capacity_factor * tokens * k / experts). Copies beyond an expert's
capacity are dropped (earlier tokens first) and counted; they contribute
nothing to the token's output. The fixed shape is what the padded batched GEMM
and fixed-size all-to-all baselines need.
"""

import math

import jax
import jax.numpy as jnp

from MaxText.moe.dispatch import Dispatched
from MaxText.moe.permute import gather_rows


class CapacityDispatcher:
  def __init__(self, capacity_factor: float):
    self.capacity_factor = capacity_factor

  def capacity(self, tokens: int, k: int, num_experts: int) -> int:
    return max(1, math.ceil(self.capacity_factor * tokens * k / num_experts))

  def dispatch(self, x: jax.Array, expert_ids: jax.Array, num_experts: int) -> Dispatched:
    tokens, k = expert_ids.shape
    cap = self.capacity(tokens, k, num_experts)
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # stable: earlier tokens claim slots first
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[order]]
    rank = jnp.zeros_like(flat).at[order].set(rank_sorted)
    kept = rank < cap
    slot = jnp.where(kept, flat * cap + rank, num_experts * cap)  # out of range = dropped
    copies = jnp.repeat(x, k, axis=0)
    rows = jnp.zeros((num_experts * cap, x.shape[1]), x.dtype).at[slot].set(copies, mode="drop")
    group_sizes = jnp.full((num_experts,), cap, jnp.int32)
    dropped = jnp.sum(~kept).astype(jnp.int32)
    return Dispatched(rows, group_sizes, dropped, slot)

  def rows_of(self, a: jax.Array, dispatched: Dispatched) -> jax.Array:
    """Any per-token array [tokens, ...] in the slots dispatch gave x's copies (empty slots zero); no gradient."""
    rows, k = dispatched.rows.shape[0], dispatched.context.shape[0] // a.shape[0]
    copies = jnp.repeat(jax.lax.stop_gradient(a), k, axis=0)
    return jnp.zeros((rows, *a.shape[1:]), a.dtype).at[dispatched.context].set(copies, mode="drop")

  def combine(self, y: jax.Array, weights: jax.Array, dispatched: Dispatched) -> jax.Array:
    tokens, k = weights.shape
    per_copy = gather_rows(y, dispatched.context).reshape(tokens, k, -1)
    out = jnp.einsum("tkd,tk->td", per_copy.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(y.dtype)
