"""The routed experts under expert parallelism: one shard_map over the whole mesh.

Tokens enter sharded like activations ("batch", "seq", ...), routing results likewise, and the
expert weights split over "exp" and, along their embed dim, over the FSDP axes as stored; every spec
comes from LOGICAL_RULES. Inside, each device all-gathers its experts' weights over FSDP in the compute
dtype, and their gradient (the largest of the step) leaves as a reduce-scatter in
weight_grad_reduce_dtype (sharding.gather_weights). Each device holds its tokens and its num_experts / R
local experts, R = the size of the mesh axis "exp" maps to, and the backend moves copies to the experts'
ranks and back. Ranks along other token axes (data, fsdp) run independent exchanges; ranks along axes
the tokens are not split over (tensor) repeat the same work. The overflow and byte counters are summed
over all token shards.
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from MaxText.config_schema import MoEConfig
from MaxText.moe.ep import EpPlan, get_backend
from MaxText.sharding import LOGICAL_RULES, MESH_AXES, gather_weights, logical_to_spec


def _axes(name: str) -> tuple[str, ...]:
  rule = LOGICAL_RULES[name]
  return () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)


def ep_axis() -> str:
  axes = _axes("exp")
  assert len(axes) == 1, f"expert parallelism needs 'exp' mapped to one mesh axis, not {axes}"
  assert axes[0] in _axes("batch"), f"tokens must be split over the expert axis {axes[0]} ('batch' -> {_axes('batch')})"
  return axes[0]


def single_device_mesh() -> Mesh:
  return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def routed_ep(
  experts, weights: dict, x: jax.Array, expert_ids: jax.Array, combine_w: jax.Array, cfg: MoEConfig, mesh: Mesh | None
):
  """x [batch, seq, embed], expert_ids/combine_w [batch*seq, k] -> ([batch, seq, embed], overflow, sent, sent_nodedup).

  `experts(w_local, rows, group_sizes)` runs the local experts' GEMMs; `weights` holds wi_0/wi_1/wo.
  """
  mesh = mesh if mesh is not None else single_device_mesh()
  axis = ep_axis()
  ranks = mesh.shape[axis]
  if cfg.num_experts % ranks:
    raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the expert-parallel size {ranks}")
  batch, seq, _ = x.shape
  k = expert_ids.shape[-1]
  token_axes = tuple(a for a in _axes("batch") if a in mesh.shape)
  if batch % math.prod(mesh.shape[a] for a in token_axes):
    raise ValueError(f"batch {batch} is not divisible by the token shards {token_axes} of mesh {dict(mesh.shape)}")
  backend = get_backend(cfg.moe_dispatch)
  x_spec = logical_to_spec(("batch", "seq", "act_embed"))
  route_spec = logical_to_spec(("batch", "seq", None))
  fsdp = tuple(a for a in _axes("embed") if mesh.shape.get(a, 1) > 1)  # the weights' embed dim is split over these
  wi_spec = logical_to_spec(("exp", "embed" if fsdp else None, None))
  wo_spec = logical_to_spec(("exp", None, "embed" if fsdp else None))

  def body(x, ids, w, wi_0, wi_1, wo):
    b, s, d = x.shape
    if fsdp:
      reduce = cfg.weight_grad_reduce_dtype
      wi_0, wi_1 = gather_weights(wi_0, fsdp, 1, reduce), gather_weights(wi_1, fsdp, 1, reduce)
      wo = gather_weights(wo, fsdp, 2, reduce)
    plan = EpPlan(axis, ranks, cfg.num_experts, k, b * s, cfg.moe_dedup, cfg.moe_ep_buffer_factor)
    with jax.named_scope("ep_dispatch"):
      got = backend.dispatch(x.reshape(b * s, d), ids.reshape(b * s, k), w.reshape(b * s, k), plan)
    y = experts({"wi_0": wi_0, "wi_1": wi_1, "wo": wo}, got.rows, got.group_sizes)
    with jax.named_scope("ep_combine"):
      out = backend.combine(y, got, plan).reshape(b, s, d)
    counters = (jax.lax.psum(c, token_axes) for c in (got.overflow, got.sent_bytes, got.sent_bytes_nodedup))
    return (out, *counters)

  run = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(x_spec, route_spec, route_spec, wi_spec, wi_spec, wo_spec),
    out_specs=(x_spec, PartitionSpec(), PartitionSpec(), PartitionSpec()),
  )
  ids = expert_ids.reshape(batch, seq, k)
  cw = combine_w.reshape(batch, seq, k)
  return run(x, ids, cw, weights["wi_0"], weights["wi_1"], weights["wo"])
