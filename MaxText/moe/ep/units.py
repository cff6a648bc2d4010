"""What travels between EP ranks: token copies grouped into *units*, sender and receiver side.

Sender (`make_units`): every copy (token t, slot j) goes to rank expert_ids[t, j] // L (L local
experts per rank) as local expert expert_ids[t, j] % L. Without dedup each copy is one unit with
one slot. With dedup a token sends one unit to each rank it uses, carrying up to S = min(k, L)
slots (local expert id, combine weight): a token that picks several experts of one rank crosses
the network once. Units are sorted by destination rank (stably, so by token within a rank); empty
candidates sort last.

Receiver (`expert_rows`, `unit_outputs`): the received units' slots are permuted into local-expert
order with the single-device permutation (`MaxText/moe/permute.py`; empty slots have id -1 and
are ignored there), and after the expert GEMMs each unit's slots are summed with their weights in
float32: the unit returns pre-combined, one row however many of its token's experts live here.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.moe import permute


class Units(NamedTuple):
  token: jax.Array  # [U] int32 source token of each unit; T (out of range) for an empty unit
  rank: jax.Array  # [U] int32 destination rank, ascending; R for an empty unit
  slot_ids: jax.Array  # [U, S] int32 local expert ids; -1 = empty slot
  slot_w: jax.Array  # [U, S] float32 combine weights; 0 in empty slots
  counts: jax.Array  # [R] int32 units per destination rank
  starts: jax.Array  # [R] int32 first unit of each destination rank


def make_units(expert_ids: jax.Array, weights: jax.Array, ranks: int, local_experts: int, dedup: bool) -> Units:
  tokens, k = expert_ids.shape
  dest, local = expert_ids // local_experts, expert_ids % local_experts
  weights = weights.astype(jnp.float32)
  if not dedup:
    rank = dest.reshape(-1)
    token = jnp.arange(tokens * k, dtype=jnp.int32) // k
    slot_ids, slot_w = local.reshape(-1, 1), weights.reshape(-1, 1)
  else:
    slots = min(k, local_experts)
    hit = dest[:, None, :] == jnp.arange(ranks, dtype=jnp.int32)[None, :, None]  # [T, R, k]
    first = jnp.argsort(~hit, axis=-1, stable=True)[..., :slots]  # this rank's slots first, in k order
    keep = jnp.take_along_axis(hit, first, axis=-1)
    slot_ids = jnp.where(keep, jnp.take_along_axis(jnp.broadcast_to(local[:, None, :], hit.shape), first, axis=-1), -1)
    slot_w = jnp.where(keep, jnp.take_along_axis(jnp.broadcast_to(weights[:, None, :], hit.shape), first, axis=-1), 0.0)
    slot_ids, slot_w = slot_ids.reshape(tokens * ranks, slots), slot_w.reshape(tokens * ranks, slots)
    rank = jnp.where(jnp.any(hit, axis=-1), jnp.arange(ranks, dtype=jnp.int32)[None, :], ranks).reshape(-1)
    token = jnp.arange(tokens * ranks, dtype=jnp.int32) // ranks
  order = jnp.argsort(rank, stable=True)
  if dedup:  # at most min(k, R) units per token are real; the rest sort last and are cut
    order = order[: tokens * min(k, ranks)]
  rank, token = rank[order], token[order]
  token = jnp.where(rank < ranks, token, tokens)
  counts = jnp.zeros((ranks + 1,), jnp.int32).at[rank].add(1)[:ranks]
  starts = jnp.cumsum(counts) - counts
  return Units(token, rank, slot_ids[order].astype(jnp.int32), slot_w[order], counts, starts)


def slots_used(u: Units) -> jax.Array:
  """[U] int32: the copies each unit carries."""
  return jnp.sum(u.slot_ids >= 0, axis=-1, dtype=jnp.int32)


def payload_bytes(
  u: Units, me: jax.Array, expert_ids: jax.Array, local_experts: int, row_bytes: int
) -> tuple[jax.Array, jax.Array]:
  """Bytes this rank sends to other ranks for its units, dispatch (row + S ids + S weights) plus the
  returned row; and the same for one unit per copy (no dedup), from the routing itself."""
  remote_units = jnp.sum((u.rank != me) & (u.rank < u.counts.shape[0])).astype(jnp.float32)
  remote_copies = jnp.sum(expert_ids // local_experts != me).astype(jnp.float32)
  slots = u.slot_ids.shape[1]
  return remote_units * (2 * row_bytes + 8 * slots), remote_copies * (2 * row_bytes + 8)


def fits(u: Units, capacity: jax.Array) -> jax.Array:
  """[U] bool: the unit lies within the first `capacity[rank]` units to its rank."""
  ranks = u.counts.shape[0]
  pos = jnp.arange(u.rank.shape[0], dtype=jnp.int32) - u.starts[jnp.minimum(u.rank, ranks - 1)]
  return (u.rank < ranks) & (pos < capacity[jnp.minimum(u.rank, ranks - 1)])


def expert_rows(units_x: jax.Array, slot_ids: jax.Array, local_experts: int) -> tuple[jax.Array, permute.Plan]:
  """Received units [N, embed] with slots [N, S] -> rows [N*S, embed] in local-expert order."""
  plan = permute.plan(slot_ids, local_experts)
  return permute.permute(units_x, plan), plan


def unit_outputs(y: jax.Array, slot_w: jax.Array, plan: permute.Plan) -> jax.Array:
  """Expert outputs in row order -> [N, embed] float32, each unit's slots summed with their weights."""
  return permute.unpermute(y, slot_w, plan, out_dtype=jnp.float32)
