"""Expert-parallel dispatch/combine by all-gather and reduce-scatter (the simple baseline).

Every rank gathers all tokens of its EP group with their expert ids and weights, runs its local
experts on the copies routed to them, sums each token's local outputs with their weights, and a
reduce-scatter adds the partial sums of all ranks and hands each rank its own tokens back. No
buffer can overflow (every copy has a row) and each token crosses once per rank whatever it
picked, so moe_dedup changes nothing here and moe_ep_buffer_factor does not apply. The rows hold
all R*T*k slots (most of them empty), so memory grows with the EP size.
"""

import jax
import jax.numpy as jnp

from MaxText.moe.ep import EpPlan, Received
from MaxText.moe.ep.units import expert_rows, unit_outputs


def dispatch(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, plan: EpPlan) -> Received:
  me, local = jax.lax.axis_index(plan.axis), plan.local_experts
  with jax.named_scope("allgather_dispatch"):
    all_x, all_ids, all_w = (
      jax.lax.all_gather(a, plan.axis, tiled=True) for a in (x, expert_ids, weights.astype(jnp.float32))
    )
  with jax.named_scope("local_permute"):
    slot_ids = jnp.where(all_ids // local == me, all_ids % local, -1)
    rows, pplan = expert_rows(all_x, slot_ids, local)
  # Ring collectives: each rank sends blocks of T rows (+ ids and weights) to gather and
  # blocks of T output rows to reduce-scatter.
  row_bytes = x.shape[1] * x.dtype.itemsize
  sent = jnp.float32((plan.ranks - 1) * plan.tokens * (2 * row_bytes + 8 * plan.k))
  return Received(rows, pplan.group_sizes, jnp.zeros((), jnp.int32), sent, sent, (pplan, all_w))


def combine(y: jax.Array, received: Received, plan: EpPlan) -> jax.Array:
  pplan, all_w = received.context
  with jax.named_scope("local_unpermute"):
    partial = unit_outputs(y, all_w, pplan).astype(y.dtype)
  with jax.named_scope("reduce_scatter_combine"):
    return jax.lax.psum_scatter(partial, plan.axis, scatter_dimension=0, tiled=True)
