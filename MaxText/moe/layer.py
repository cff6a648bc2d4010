"""The DeepSeekMoE feed-forward block: shared experts plus routed experts.

    y = shared(x) + sum_{e in topk(x)} w_e * expert_e(x)

Routing is in `router.py`, the permutation in `dispatch/`, the expert GEMMs in
`gmm/`; this file wires them together for one layer and reports the expert
load (for the bias update and the step log) and the dropped copies.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config_schema import MoEConfig
from MaxText.layers.mlp import mlp, mlp_specs
from MaxText.moe import router
from MaxText.moe.dispatch import get_dispatcher
from MaxText.moe.gmm import get_gmm
from MaxText.params import ParamSpec


class MoEStats(NamedTuple):
  load: jax.Array  # [experts] int32 token copies routed to each expert
  dropped: jax.Array  # scalar int32 copies dropped by a capacity limit
  balance_loss: jax.Array  # scalar float32 sequence-wise auxiliary loss (unweighted)


def moe_specs(emb_dim: int, cfg: MoEConfig) -> dict:
  e, f = cfg.num_experts, cfg.base_moe_mlp_dim
  specs = {
      "gate": ParamSpec((emb_dim, e), ("embed", "exp_router")),
      "wi_0": ParamSpec((e, emb_dim, f), ("exp", "embed", "mlp")),
      "wi_1": ParamSpec((e, emb_dim, f), ("exp", "embed", "mlp")),
      "wo": ParamSpec((e, f, emb_dim), ("exp", "mlp", "embed")),
  }
  if cfg.shared_experts:
    specs["shared"] = mlp_specs(emb_dim, f * cfg.shared_experts)
  return specs


def routed_experts(p: dict, rows: jax.Array, group_sizes: jax.Array, gmm) -> jax.Array:
  with jax.named_scope("gmm"):
    gate = gmm(rows, p["wi_0"], group_sizes)
    up = gmm(rows, p["wi_1"], group_sizes)
    return gmm(jax.nn.silu(gate) * up, p["wo"], group_sizes)


def moe(p: dict, x: jax.Array, bias: jax.Array, cfg: MoEConfig, shard) -> tuple[jax.Array, MoEStats]:
  """x [batch, seq, embed] -> ([batch, seq, embed], stats)."""
  batch, seq, d = x.shape
  tokens = x.reshape(batch * seq, d)
  with jax.named_scope("router"):
    r = router.route(tokens, p["gate"], bias, cfg)
  dispatcher = get_dispatcher(cfg.moe_dispatch, cfg.capacity_factor)
  with jax.named_scope("permute"):
    dispatched = dispatcher.dispatch(tokens, r.expert_ids, cfg.num_experts)
  y = routed_experts(p, dispatched.rows, dispatched.group_sizes, get_gmm(cfg.moe_gmm_backend))
  with jax.named_scope("combine"):
    out = dispatcher.combine(y, r.weights, dispatched).reshape(batch, seq, d)
  if cfg.shared_experts:
    with jax.named_scope("shared_experts"):
      out = out + mlp(p["shared"], x, shard)
  balance = router.sequence_balance_loss(r, batch, cfg) if cfg.load_balance_loss_weight > 0 else jnp.zeros((), jnp.float32)
  return out, MoEStats(router.expert_load(r.expert_ids, cfg.num_experts), dispatched.dropped, balance)
