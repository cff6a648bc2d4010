"""Dropless dispatch by sorting token copies by expert id (the reference path).

Each token's k copies are stably sorted by expert, so every expert's rows are
contiguous and a grouped GEMM can run over them; combine gathers the rows back
through the inverse permutation and sums each token's k outputs weighted in
float32. Nothing is dropped and no [tokens, experts] mask is built.
"""

import jax
import jax.numpy as jnp

from MaxText.moe.dispatch import Dispatched


class SortDispatcher:
  def dispatch(self, x: jax.Array, expert_ids: jax.Array, num_experts: int) -> Dispatched:
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x, order // k, axis=0)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return Dispatched(rows, group_sizes, jnp.zeros((), jnp.int32), order)

  def combine(self, y: jax.Array, weights: jax.Array, dispatched: Dispatched) -> jax.Array:
    tokens, k = weights.shape
    inverse = jnp.argsort(dispatched.context)
    per_copy = jnp.take(y, inverse, axis=0).reshape(tokens, k, -1)
    out = jnp.einsum("tkd,tk->td", per_copy.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(y.dtype)
