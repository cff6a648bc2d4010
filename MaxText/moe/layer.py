"""The DeepSeekMoE feed-forward block: shared experts plus routed experts.

    y = shared(x) + sum_{e in topk(x)} w_e * expert_e(x)

Routing is in `router.py`, the permutation in `dispatch/`, the expert GEMMs in
`MaxText/gmm/`; this file wires them together for one layer and reports the expert
load (for the bias update and the step log) and the dropped copies. Under
expert parallelism (moe_dispatch = ragged_a2a | dense_a2a | allgather) the
routed experts run in `ep/` over the mesh that `shard` carries; the shared
experts do not depend on the dispatch, so XLA may overlap them with it.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText import gmm
from MaxText.config_schema import MoEConfig
from MaxText.gmm.base import ExpertGemm
from MaxText.layers import linear
from MaxText.layers.linear import PLAIN, Dense
from MaxText.layers.mlp import mlp, mlp_specs
from MaxText.moe import ep, router
from MaxText.moe.dispatch import get_dispatcher
from MaxText.params import ParamSpec


class MoEStats(NamedTuple):
  load: jax.Array  # [experts] int32 token copies routed to each expert
  dropped: jax.Array  # scalar int32 copies dropped by a capacity limit
  balance_loss: jax.Array  # scalar float32 sequence-wise auxiliary loss (unweighted)
  # Expert parallelism (0 otherwise): copies that did not fit a moe_ep_buffer_factor buffer (the
  # step must not be applied), and payload bytes sent between EP ranks with / without dedup.
  ep_overflow: jax.Array | int = 0  # scalar int32
  ep_sent_bytes: jax.Array | float = 0.0  # scalar float32
  ep_sent_bytes_nodedup: jax.Array | float = 0.0  # scalar float32


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


def routed_experts(p: dict, rows: jax.Array, group_sizes: jax.Array, gemm: ExpertGemm, rows_q=None) -> jax.Array:
  """The experts' SwiGLU MLP on rows grouped by expert. rows_q: the rows already quantised by
  gemm.quantize_rows (before the permute), for the gate/up GEMM."""
  with jax.named_scope("gmm"):
    # Checkpoint names (MaxText/remat.py): top-k times the tokens, the largest activations of the layer.
    # Gate and up as one GEMM of twice the width: the rows are read (and quantised) once, the backward
    # writes one dx instead of two to be added, and the shape is the one the kernels are tuned and
    # benchmarked at. The concatenation fuses into the weights' cast to the compute dtype.
    w_gate_up = jnp.concatenate([p["wi_0"], p["wi_1"]], axis=-1)
    if rows_q is None:
      gate_up = gemm(rows, w_gate_up, group_sizes)
    else:
      gate_up = gemm.from_quantized_rows(rows, rows_q, w_gate_up, group_sizes)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate, up = checkpoint_name(gate, "moe_mlpwi_0"), checkpoint_name(up, "moe_mlpwi_1")
    return checkpoint_name(gemm.swiglu_down(gate, up, p["wo"], group_sizes), "moe_mlpwo")


def expert_gemm(cfg: MoEConfig) -> ExpertGemm:
  """The expert GEMM of `cfg`, whose moe_gmm_backend the Trainer resolved (and logged); mxfp8_impl=auto is
  decided here for the default device when a layer is built on its own."""
  quantization = cfg.quantization if "experts" in linear.parse_groups(cfg.quantize_layers) else ""
  name = gmm.entry_name(quantization, cfg.moe_gmm_backend, gmm.resolve_mxfp8(cfg.mxfp8_impl, jax.devices()[0]))
  return gmm.build(name, gmm.Options(cfg.quantize_with_activation, cfg.quantize_before_permute))


def moe(
  p: dict, x: jax.Array, bias: jax.Array, cfg: MoEConfig, shard, dense: Dense = PLAIN
) -> tuple[jax.Array, MoEStats]:
  """x [batch, seq, embed] -> ([batch, seq, embed], stats); dense runs the shared experts' GEMMs."""
  batch, seq, d = x.shape
  tokens = x.reshape(batch * seq, d)
  shared = None
  if cfg.shared_experts:  # independent of the routed path, so it can overlap the dispatch
    with jax.named_scope("shared_experts"):
      shared = mlp(p["shared"], x, shard, dense, "shared_experts")
  with jax.named_scope("router"):
    r = router.route(tokens, p["gate"], bias, cfg)
  balance = (
    router.sequence_balance_loss(r, batch, cfg) if cfg.load_balance_loss_weight > 0 else jnp.zeros((), jnp.float32)
  )
  load = router.expert_load(r.expert_ids, cfg.num_experts)
  if ep.is_ep(cfg.moe_dispatch):
    from MaxText.moe.ep.parallel import routed_ep

    gemm = expert_gemm(cfg)

    def experts(w, rows, sizes):
      return routed_experts(w, rows, sizes, gemm)

    out, overflow, sent, nodedup = routed_ep(experts, p, x, r.expert_ids, r.weights, cfg, shard.mesh)
    out = out if shared is None else out + shared
    return out, MoEStats(load, jnp.zeros((), jnp.int32), balance, overflow, sent, nodedup)
  dispatcher = get_dispatcher(cfg.moe_dispatch, cfg.capacity_factor, cfg.moe_group_pad_multiple)
  gemm = expert_gemm(cfg)
  rows_q = None
  with jax.named_scope("permute"):
    dispatched = dispatcher.dispatch(tokens, r.expert_ids, cfg.num_experts)
    # A row-local format (fp8_blockwise's 1x128 scales along the hidden axis) quantises each token once and
    # moves fp8 rows: the top-k copies' quantisation pass and the bf16 row gather are then dead code.
    if (tq := gemm.quantize_rows(tokens)) is not None:
      rows_q = tq._replace(q=dispatcher.rows_of(tq.q, dispatched), scale=dispatcher.rows_of(tq.scale, dispatched))
  y = routed_experts(p, dispatched.rows, dispatched.group_sizes, gemm, rows_q)
  with jax.named_scope("combine"):
    out = dispatcher.combine(y, r.weights, dispatched).reshape(batch, seq, d)
  if shared is not None:
    out = out + shared
  zero = jnp.zeros((), jnp.float32)
  return out, MoEStats(load, dispatched.dropped, balance, jnp.zeros((), jnp.int32), zero, zero)
