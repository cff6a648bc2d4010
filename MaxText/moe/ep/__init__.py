"""Expert parallelism: the routed experts split over the mesh axis `expert`, tokens moved to them
and back inside one `shard_map`, one module per transport, chosen by `moe_dispatch`.

Interface (every backend module), called per device inside the shard_map:
  dispatch(x [T, embed], expert_ids [T, k], weights [T, k], plan) -> Received
      this rank's rows in local-expert order, `group_sizes` [local experts], what did not fit
      (`overflow`, token copies), the payload bytes sent, and the context `combine` needs
  combine(y [rows, embed], received, plan) -> [T, embed]
      each token's weighted sum over its k experts, accumulated in float32

  ragged_a2a  jax.lax.ragged_all_to_all sized by all-gathered counts (GPU; XLA:CPU has none)
  dense_a2a   fixed [ranks, capacity] buffers and jax.lax.all_to_all (runs anywhere)
  allgather   all-gather the tokens, run the local experts, reduce-scatter the outputs

Token copies travel as *units* (units.py): without dedup one unit per copy; with `moe_dedup` one
unit per (token, destination rank) carrying that rank's local expert ids and weights, expanded and
pre-combined on the receiver. Buffers are sized for the worst case unless `moe_ep_buffer_factor`
> 0; then copies that do not fit are counted on device every step (`overflow`), never silently
lost: the train step refuses the update and the loop stops with an error (train.py).
"""

import importlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax

BACKENDS = {
  "ragged_a2a": "MaxText.moe.ep.ragged_a2a",
  "dense_a2a": "MaxText.moe.ep.dense_a2a",
  "allgather": "MaxText.moe.ep.allgather",
}


@dataclass(frozen=True)
class EpPlan:
  """Static facts of one EP exchange (per device)."""

  axis: str  # mesh axis the experts are split over
  ranks: int  # its size
  num_experts: int
  k: int  # experts per token
  tokens: int  # tokens on this device
  dedup: bool
  buffer_factor: float  # -1: worst case; f > 0: f x the balanced share, overflow detected

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.ranks

  @property
  def slots(self) -> int:
    """Expert slots a unit carries: one copy, or with dedup every expert of a token on one rank."""
    return min(self.k, self.local_experts) if self.dedup else 1

  @property
  def worst_pair_units(self) -> int:
    """Most units one rank can send another: each token once (dedup) or once per expert there."""
    return self.tokens * (1 if self.dedup else min(self.k, self.local_experts))

  def bounded(self, worst: int, balanced_copies: float) -> int:
    """A buffer of `worst` units, or buffer_factor x the balanced copies (at most worst, at least 1)."""
    if self.buffer_factor <= 0:
      return worst
    return max(1, min(worst, math.ceil(self.buffer_factor * balanced_copies)))


class Received(NamedTuple):
  rows: jax.Array  # [rows, embed] in local-expert order; rows past sum(group_sizes) are zero
  group_sizes: jax.Array  # [local experts] int32
  overflow: jax.Array  # scalar int32: token copies that did not fit a buffer (not computed)
  sent_bytes: jax.Array  # scalar float32: payload bytes this device sent to other ranks, both ways
  sent_bytes_nodedup: jax.Array  # scalar float32: the same without dedup (counted from the routing)
  context: Any  # backend-specific, for combine


class EpBackend(Protocol):
  def dispatch(self, x: jax.Array, expert_ids: jax.Array, weights: jax.Array, plan: EpPlan) -> Received: ...

  def combine(self, y: jax.Array, received: Received, plan: EpPlan) -> jax.Array: ...


def is_ep(name: str) -> bool:
  return name in BACKENDS


def get_backend(name: str) -> EpBackend:
  if name not in BACKENDS:
    raise ValueError(f"unknown expert-parallel moe_dispatch '{name}'; choose one of: {', '.join(BACKENDS)}")
  return importlib.import_module(BACKENDS[name])


def unavailable(name: str, platform: str) -> str | None:
  """Why backend `name` cannot run on devices of `platform` ("gpu", "cpu"), or None."""
  if name == "ragged_a2a" and platform != "gpu":
    return "jax.lax.ragged_all_to_all runs on GPUs (XLA:CPU has none)"
  return None
