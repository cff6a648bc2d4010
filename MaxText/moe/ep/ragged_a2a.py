"""Expert-parallel dispatch/combine with jax.lax.ragged_all_to_all: only the units move.

Each rank's units are sorted by destination; the per-destination counts are all-gathered into a
[source, destination] matrix from which every rank computes, without further communication, where
its slice lands in each receiver's buffer (the units of lower-numbered sources first) and what it
receives. The receiver permutes the received units to local-expert order; on the way back the same
offsets are used in reverse. The receive buffer holds the worst case by default (every unit of
every rank); with moe_ep_buffer_factor f > 0 it holds f x the balanced T*k copies, and slices that
would run past it are cut (consistently on both sides, from the shared matrix) and counted.
XLA:CPU has no ragged all-to-all: this runs on GPUs (its lowering is tested compile-only).
"""

import jax
import jax.numpy as jnp

from MaxText.moe.ep import EpPlan, Received
from MaxText.moe.ep.units import expert_rows, fits, make_units, payload_bytes, slots_used, unit_outputs
from MaxText.moe.permute import gather_rows


def receive_buffer(plan: EpPlan) -> int:
  return plan.bounded(plan.ranks * plan.worst_pair_units, plan.tokens * plan.k)


def _buffer(like: jax.Array, rows: int, fill) -> jax.Array:
  # *_like: the buffer varies over the same mesh axes as what is written into it (shard_map types).
  return jnp.full_like(like, fill, shape=(rows, *like.shape[1:]))


def _exchange(operand, output, in_off, sizes, out_off, recv, axis):
  # A slice of size 0 may start anywhere; keep its offset inside the buffer all the same.
  in_off = jnp.minimum(in_off, operand.shape[0] - 1)
  out_off = jnp.minimum(out_off, output.shape[0] - 1)
  return jax.lax.ragged_all_to_all(operand, output, in_off, sizes, out_off, recv, axis_name=axis)


def dispatch(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, plan: EpPlan) -> Received:
  ranks, d = plan.ranks, x.shape[1]
  me = jax.lax.axis_index(plan.axis)
  with jax.named_scope("ep_units"):
    u = make_units(expert_ids, weights, ranks, plan.local_experts, plan.dedup)
    room = receive_buffer(plan)
    counts = jax.lax.all_gather(u.counts, plan.axis)  # [source, destination]
    starts = jnp.cumsum(counts, axis=1) - counts  # where each slice starts in its sender's units
    offsets = jnp.cumsum(counts, axis=0) - counts  # where it would start in its receiver's buffer
    sizes = jnp.clip(room - offsets, 0, counts)  # what fits
    send_x = gather_rows(x, u.token)
  with jax.named_scope("a2a_dispatch"):
    args = (starts[me], sizes[me], offsets[me], sizes[:, me], plan.axis)
    recv_x = _exchange(send_x, _buffer(send_x, room, 0), *args)
    recv_ids = _exchange(u.slot_ids, _buffer(u.slot_ids, room, -1), *args)
    recv_w = _exchange(u.slot_w, _buffer(u.slot_w, room, 0), *args)
  with jax.named_scope("local_permute"):
    rows, pplan = expert_rows(recv_x, recv_ids, plan.local_experts)
  overflow = jnp.sum(jnp.where(fits(u, sizes[me]) | (u.rank >= ranks), 0, slots_used(u)))
  sent, nodedup = payload_bytes(u, me, expert_ids, plan.local_experts, d * x.dtype.itemsize)
  return Received(rows, pplan.group_sizes, overflow, sent, nodedup, (pplan, recv_w, u.token, starts, offsets, sizes))


def combine(y: jax.Array, received: Received, plan: EpPlan) -> jax.Array:
  pplan, recv_w, token, starts, offsets, sizes = received.context
  me = jax.lax.axis_index(plan.axis)
  with jax.named_scope("local_unpermute"):
    out_units = unit_outputs(y, recv_w, pplan).astype(y.dtype)
  with jax.named_scope("a2a_combine"):
    back = _exchange(
      out_units,
      _buffer(out_units, token.shape[0], 0),
      offsets[:, me],
      sizes[:, me],
      starts[:, me],
      sizes[me],
      plan.axis,
    )
  with jax.named_scope("ep_combine"):
    out = jnp.zeros((plan.tokens, y.shape[1]), jnp.float32).at[token].add(back.astype(jnp.float32), mode="drop")
  return out.astype(y.dtype)
