"""Rematerialisation (activation checkpointing) policies for the decoder layers.

`remat_policy` picks what a layer keeps from its forward pass for the backward pass; the
rest is recomputed. The model tags its large intermediate tensors with
`jax.ad_checkpoint.checkpoint_name` (names as upstream MaxText); the presets and `custom` are
sets of those names. Under `custom` each tensor key (a config key of its own) is one of

  remat    recompute it in the backward pass (nothing kept)
  device   keep it in device memory
  offload  keep it in pinned host memory: copied out in the forward pass and back for the
           backward pass (jax.checkpoint_policies.save_and_offload_only_these_names), so XLA
           can overlap the copies with compute

Tensors, per decoder layer (shapes: B batch, S sequence, H heads, R routed rows = B*S*top-k):

  decoder_layer_input  [B,S,D]       the layer input (the residual stream)
  mla_q                [B,S,q_lora]  low-rank query x @ wq_a (only with q_lora_rank > 0)
  mla_kv               [B,S,kv_lora+rope]  low-rank key/value latent and rotary key x @ wkv_a
  query_proj           [B,S,H,qk]    the full query the attention reads (rotary applied)
  key_proj             [B,S,H,qk]    the full key
  value_proj           [B,S,H,v]     the value
  attention_out        [B,S,H,v]     the attention output before the output projection
  out_proj             [B,S,D]       the attention output projection (wo)
  mlpwi_0, mlpwi_1     [B,S,F]       gate and up projections of the dense MLP and the shared experts
  mlpwi                [B,S,F]       silu(gate) * up, the input of mlpwo
  mlpwo                [B,S,D]       the MLP output projection
  moe_mlpwi_0, moe_mlpwi_1  [R,F]    the routed experts' gate and up grouped GEMMs
  moe_mlpwo            [R,D]         the routed experts' down grouped GEMM, before the combine

`minimal` keeps every matmul output without a batch dimension (jax's
dots_with_no_batch_dims_saveable); `full` keeps only the layer inputs the scan carries.
"""

import dataclasses

import jax
import jax.numpy  # noqa: F401 - tensor_bytes reads dtype sizes

from MaxText.config_schema import REMAT_LOCATIONS, ModelConfig

# Attention projections: cheap to keep next to what they save (the MoE rows dominate memory).
_ATTENTION_PROJ = ("mla_q", "mla_kv", "query_proj", "key_proj", "value_proj", "out_proj")
# remat_policy -> the tensors kept in device memory (the name-based presets).
NAMED_PRESETS = {
  "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
  "save_out_proj": ("out_proj",),
  # Keep the attention projections, recompute the dense MLPs, shared and routed experts.
  "save_dot_except_mlp": _ATTENTION_PROJ,
  # Keep the attention projections and the dense/shared MLPs' inner activations, recompute the routed
  # experts only (their rows are top-k times the tokens: the largest activations of an MoE layer).
  # (mlpwo is never kept: it is only added to the residual stream, whose backward does not read it.)
  "save_dot_except_moe": (*_ATTENTION_PROJ, "mlpwi_0", "mlpwi_1", "mlpwi"),
}


def tensor_keys() -> tuple[str, ...]:
  """The per-tensor config keys: ModelConfig fields that take remat | device | offload."""
  return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("choices") == REMAT_LOCATIONS)


def custom_locations(m: ModelConfig) -> dict[str, str]:
  return {name: getattr(m, name) for name in tensor_keys()}


def offloaded(m: ModelConfig) -> tuple[str, ...]:
  """The tensors this config keeps in host memory (only remat_policy=custom offloads)."""
  if m.remat_policy != "custom":
    return ()
  return tuple(n for n, where in custom_locations(m).items() if where == "offload")


def checkpoint_policy(m: ModelConfig):
  """The jax.checkpoint policy for remat_policy (None for `none`: no jax.checkpoint at all)."""
  p = m.remat_policy
  if p == "none":
    return None
  if p == "full":
    return jax.checkpoint_policies.nothing_saveable
  if p == "minimal":
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  if p in NAMED_PRESETS:
    return jax.checkpoint_policies.save_only_these_names(*NAMED_PRESETS[p])
  assert p == "custom", p
  where = custom_locations(m)
  saved = [n for n, w in where.items() if w == "device"]
  host = [n for n, w in where.items() if w == "offload"]
  if not host:
    return jax.checkpoint_policies.save_only_these_names(*saved)
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=saved, names_which_can_be_offloaded=host, offload_src="device", offload_dst="pinned_host"
  )


def remat(fn, m: ModelConfig, scanned: bool):
  """fn under jax.checkpoint with the configured policy (fn itself for remat_policy=none)."""
  policy = checkpoint_policy(m)
  if policy is None:
    return fn
  # Inside lax.scan, CSE cannot hoist the recomputation out of the backward loop, so it need not be prevented.
  return jax.checkpoint(fn, policy=policy, prevent_cse=not scanned)


def describe(m: ModelConfig) -> str:
  """One line for the log: the policy and, for custom, where each tensor lives."""
  if m.remat_policy != "custom":
    kept = NAMED_PRESETS.get(m.remat_policy)
    return f"remat_policy={m.remat_policy}" + (f" (keeps {', '.join(kept)})" if kept else "")
  groups: dict[str, list[str]] = {}
  for n, w in custom_locations(m).items():
    groups.setdefault(w, []).append(n)
  return "remat_policy=custom: " + "; ".join(f"{w}: {', '.join(ns)}" for w, ns in sorted(groups.items()))


def tensor_bytes(m: ModelConfig, moe_cfg, batch: int, seq: int, kind: str) -> dict[str, int]:
  """Bytes of each named tensor in one layer of `kind` ("dense" or "moe") for `batch` sequences of `seq`
  tokens on one device, in the compute dtype; routed rows as dropless dispatch makes them (tokens * top-k)."""
  tokens = batch * seq
  h = m.base_num_query_heads
  elems = {
    "decoder_layer_input": tokens * m.emb_dim,
    "mla_q": tokens * m.q_lora_rank,
    "mla_kv": tokens * (m.kv_lora_rank + m.qk_rope_head_dim),
    "query_proj": tokens * h * m.qk_head_dim,
    "key_proj": tokens * h * m.qk_head_dim,
    "value_proj": tokens * h * m.v_head_dim,
    "attention_out": tokens * h * m.v_head_dim,
    "out_proj": tokens * m.emb_dim,
  }
  mlp_width = m.base_mlp_dim if kind == "dense" else moe_cfg.base_moe_mlp_dim * moe_cfg.shared_experts
  if mlp_width:
    elems.update(
      mlpwi_0=tokens * mlp_width, mlpwi_1=tokens * mlp_width, mlpwi=tokens * mlp_width, mlpwo=tokens * m.emb_dim
    )
  if kind == "moe":
    rows = tokens * moe_cfg.num_experts_per_tok
    elems.update(
      moe_mlpwi_0=rows * moe_cfg.base_moe_mlp_dim,
      moe_mlpwi_1=rows * moe_cfg.base_moe_mlp_dim,
      moe_mlpwo=rows * m.emb_dim,
    )
  itemsize = jax.numpy.dtype(m.dtype).itemsize
  return {name: n * itemsize for name, n in elems.items() if n}
