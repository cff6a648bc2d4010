"""Token dispatch and combine: the single-device permutation between token order
and expert-grouped order, one module per strategy, chosen by `moe_dispatch`.

Interface (every backend):
  dispatch(x [tokens, embed], expert_ids [tokens, k], num_experts) -> Dispatched
      rows grouped by expert, `group_sizes` [experts] rows per expert (padding
      rows included: they are zero), and the context that `combine` needs
  combine(y [rows, embed], weights [tokens, k], dispatched) -> [tokens, embed]
      the weighted sum over each token's k experts, accumulated in float32
  rows_of(a [tokens, ...], dispatched) -> a's rows where dispatch put x's
"""

from typing import Any, NamedTuple, Protocol

import jax


class Dispatched(NamedTuple):
  rows: jax.Array  # [rows, embed], grouped by expert
  group_sizes: jax.Array  # [experts] int32; rows past their sum are padding
  dropped: jax.Array  # scalar int32: token copies not computed (always 0 when dropless)
  context: Any  # backend-specific, for combine


class Dispatcher(Protocol):
  def dispatch(self, x: jax.Array, expert_ids: jax.Array, num_experts: int) -> Dispatched: ...

  def combine(self, y: jax.Array, weights: jax.Array, dispatched: Dispatched) -> jax.Array: ...

  def rows_of(self, a: jax.Array, dispatched: Dispatched) -> jax.Array:
    """Any per-token array [tokens, ...] laid out as dispatch laid out x (padding rows zero); no gradient
    (fp8 rows quantised before the permute travel this way)."""
    ...


DISPATCHERS = ("sort", "capacity")  # single-device; the expert-parallel ones are in moe/ep/


def get_dispatcher(name: str, capacity_factor: float, group_pad_multiple: int = 0) -> Dispatcher:
  from MaxText.moe.dispatch import capacity, sort

  if name == "sort":
    return sort.SortDispatcher(group_pad_multiple)
  if name == "capacity":
    return capacity.CapacityDispatcher(capacity_factor)
  raise ValueError(f"unknown moe_dispatch '{name}'; choose one of: {', '.join(DISPATCHERS)}")
