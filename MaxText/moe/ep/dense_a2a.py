"""Expert-parallel dispatch/combine with fixed-size buffers and jax.lax.all_to_all.

Every rank pair exchanges a [capacity, embed] block (plus the units' slot ids and weights), so the
collective is a plain dense all-to-all that every backend, XLA:CPU included, runs. Capacity is the
worst case by default (a rank can receive every unit of every sender: dropless for any routing);
with moe_ep_buffer_factor f > 0 it is f x the balanced share T*k/R, and units past it are counted
as overflow. The wire carries the whole buffers, full or not; `sent_bytes` counts the payload.
"""

import jax
import jax.numpy as jnp

from MaxText.moe.ep import EpPlan, Received
from MaxText.moe.ep.units import expert_rows, fits, make_units, payload_bytes, slots_used, unit_outputs
from MaxText.moe.permute import gather_rows


def capacity(plan: EpPlan) -> int:
  return plan.bounded(plan.worst_pair_units, plan.tokens * plan.k / plan.ranks)


def dispatch(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, plan: EpPlan) -> Received:
  ranks, tokens, d = plan.ranks, x.shape[0], x.shape[1]
  me = jax.lax.axis_index(plan.axis)
  with jax.named_scope("ep_units"):
    u = make_units(expert_ids, weights, ranks, plan.local_experts, plan.dedup)
    cap, slots = capacity(plan), plan.slots
    c = jnp.arange(cap, dtype=jnp.int32)
    unit = jnp.where(c[None, :] < u.counts[:, None], u.starts[:, None] + c[None, :], u.token.shape[0]).reshape(
      -1
    )  # [R*cap]
    token = jnp.take(u.token, unit, mode="fill", fill_value=tokens)
    send_x = gather_rows(x, token).reshape(ranks, cap, d)
    send_ids = jnp.take(u.slot_ids, unit, axis=0, mode="fill", fill_value=-1).reshape(ranks, cap, slots)
    send_w = jnp.take(u.slot_w, unit, axis=0, mode="fill", fill_value=0).reshape(ranks, cap, slots)
  with jax.named_scope("a2a_dispatch"):
    recv_x, recv_ids, recv_w = (jax.lax.all_to_all(a, plan.axis, 0, 0, tiled=True) for a in (send_x, send_ids, send_w))
  with jax.named_scope("local_permute"):
    rows, pplan = expert_rows(recv_x.reshape(ranks * cap, d), recv_ids.reshape(ranks * cap, slots), plan.local_experts)
  overflow = jnp.sum(jnp.where(fits(u, jnp.full((ranks,), cap, jnp.int32)) | (u.rank >= ranks), 0, slots_used(u)))
  sent, nodedup = payload_bytes(u, me, expert_ids, plan.local_experts, d * x.dtype.itemsize)
  return Received(rows, pplan.group_sizes, overflow, sent, nodedup, (pplan, recv_w.reshape(ranks * cap, slots), token))


def combine(y: jax.Array, received: Received, plan: EpPlan) -> jax.Array:
  pplan, recv_w, token = received.context
  with jax.named_scope("local_unpermute"):
    out_units = unit_outputs(y, recv_w, pplan).astype(y.dtype)
  with jax.named_scope("a2a_combine"):
    back = jax.lax.all_to_all(out_units.reshape(plan.ranks, -1, y.shape[1]), plan.axis, 0, 0, tiled=True)
  with jax.named_scope("ep_combine"):
    out = (
      jnp.zeros((plan.tokens, y.shape[1]), jnp.float32)
      .at[token]
      .add(back.reshape(-1, y.shape[1]).astype(jnp.float32), mode="drop")
    )
  return out.astype(y.dtype)
