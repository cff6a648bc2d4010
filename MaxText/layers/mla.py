"""Multi-head latent attention (DeepSeek-V2 section 2.1, DeepSeek-V3 section 2.1.1).

Queries go through a low-rank bottleneck with its own RMSNorm (q_lora_rank; 0
means a full-rank query). Keys and values are rebuilt per head from one
compressed latent (kv_lora_rank) with its RMSNorm. The rotary part of the key
(qk_rope_head_dim) is computed once from the hidden state and shared by all
heads. Attention is causal and, for packed rows, stays within a document
(segment ids); with YaRN the softmax scale carries the mscale correction.
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.config_schema import ModelConfig
from MaxText.layers.linear import PLAIN, Dense
from MaxText.layers.norms import rms_norm, rms_norm_spec
from MaxText.layers.rope import apply_rope, yarn_mscale
from MaxText.params import ParamSpec


# Each projection's logical axes (MaxText/sharding.py): its ParamSpec's, and what its GEMM is told (linear.Dense).
AXES = {
  "wq_a": ("embed", "q_lora"),
  "wq_b": ("q_lora_in", "heads", "head_dim"),
  "wq": ("embed", "heads", "head_dim"),
  "wkv_a": ("embed", "kv_lora"),
  "wkv_b": ("kv_lora_in", "heads", "head_dim"),
  "wo": ("heads", "head_dim", "embed"),
}


def mla_specs(cfg: ModelConfig) -> dict:
  d, h = cfg.emb_dim, cfg.base_num_query_heads
  specs = {}
  if cfg.q_lora_rank > 0:
    specs["wq_a"] = ParamSpec((d, cfg.q_lora_rank), AXES["wq_a"])
    specs["q_norm"] = rms_norm_spec(cfg.q_lora_rank)
    specs["wq_b"] = ParamSpec((cfg.q_lora_rank, h, cfg.qk_head_dim), AXES["wq_b"])
  else:
    specs["wq"] = ParamSpec((d, h, cfg.qk_head_dim), AXES["wq"])
  specs["wkv_a"] = ParamSpec((d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), AXES["wkv_a"])
  specs["kv_norm"] = rms_norm_spec(cfg.kv_lora_rank)
  specs["wkv_b"] = ParamSpec((cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim), AXES["wkv_b"])
  specs["wo"] = ParamSpec((h, cfg.v_head_dim, d), AXES["wo"])
  return specs


def softmax_scale(cfg: ModelConfig) -> float:
  scale = cfg.qk_head_dim**-0.5
  if cfg.rope_type == "yarn":
    m = yarn_mscale(cfg.rope_factor, cfg.mscale)
    scale *= m * m
  return scale


def dot_product_attention(q, k, v, scale: float, segment_ids=None) -> jax.Array:
  """Causal attention with the [seq, seq] scores materialised in float32; runs anywhere.

  segment_ids [batch, seq] (packed rows): a token attends only to earlier tokens of its own
  segment. Every query keeps at least itself, so no softmax row is empty (padding, segment 0,
  attends to padding).
  """
  scores = jnp.einsum("bshk,bthk->bhst", q, k, preferred_element_type=jnp.float32) * scale
  seq = q.shape[1]
  allowed = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
  if segment_ids is not None:
    allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  probs = jax.nn.softmax(jnp.where(allowed, scores, jnp.finfo(jnp.float32).min), axis=-1)
  return jnp.einsum("bhst,bthk->bshk", probs.astype(v.dtype), v)


def cudnn_flash_attention(q, k, v, scale: float, segment_ids=None) -> jax.Array:
  """cuDNN fused flash attention (GPU only), causal. MLA's v head (v_head_dim) is narrower than q/k's
  (qk_nope + qk_rope): cuDNN >= 9.10 on Hopper or later takes the two sizes as they are; older cuDNN
  wants one size, so v is zero-padded to it and the padding sliced off (a third more work in the
  softmax-times-v products and their gradients). Packed rows are refused when the config is loaded
  (packing needs attention=dot_product)."""
  if segment_ids is not None:
    raise ValueError("cudnn_flash attention does not take segment ids; packing needs attention=dot_product")
  if v.shape[-1] != q.shape[-1] and _cudnn_takes_mla():
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # the public jax.nn API wants one head size

    return cudnn.dot_product_attention(q, k, v, scale=scale, mask_type=cudnn.MaskType.CAUSAL, qkv_layout="BTNH")
  return cudnn_flash_attention_padded(q, k, v, scale)


def cudnn_flash_attention_padded(q, k, v, scale: float) -> jax.Array:
  """cuDNN flash attention with v zero-padded to q/k's head size: every cuDNN version."""
  pad = q.shape[-1] - v.shape[-1]
  v_padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad))) if pad > 0 else v
  out = jax.nn.dot_product_attention(q, k, v_padded, scale=scale, is_causal=True, implementation="cudnn")
  return out[..., : v.shape[-1]]


@functools.cache
def _cudnn_takes_mla() -> bool:
  """cuDNN >= 9.10 on sm_90+: different q/k and v head sizes (jax's check_is_flash_attention)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    return cudnn.check_cudnn_version() >= 91000 and cudnn.check_compute_capability("9.0")
  except Exception:  # no cuDNN, or jax moved these helpers: the padded path works everywhere
    return False


ATTENTION = {"dot_product": dot_product_attention, "cudnn_flash": cudnn_flash_attention}


def mla(
  p: dict,
  x: jax.Array,
  rope: tuple[jax.Array, jax.Array],
  cfg: ModelConfig,
  shard,
  segment_ids=None,
  dense: Dense = PLAIN,
) -> jax.Array:
  """x [batch, seq, embed] -> [batch, seq, embed]; rope = (cos, sin) from rope.rope_tables;
  segment_ids [batch, seq] or None (see dot_product_attention); dense runs the projections' GEMMs
  (layers/linear.py: group "attention")."""
  eps, nope = cfg.normalization_layer_epsilon, cfg.qk_nope_head_dim

  def proj(spec: str, x: jax.Array, name: str) -> jax.Array:
    return dense(spec, x, p[name], "attention", AXES[name])

  with jax.named_scope("mla_q"):
    if cfg.q_lora_rank > 0:
      q = rms_norm(checkpoint_name(proj("bsd,dr->bsr", x, "wq_a"), "mla_q"), p["q_norm"], eps)
      q = proj("bsr,rhk->bshk", q, "wq_b")
    else:
      q = proj("bsd,dhk->bshk", x, "wq")
    q = shard(q, ("batch", "seq", "act_heads", None))
    q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], *rope)

  with jax.named_scope("mla_kv"):
    kv_a = checkpoint_name(proj("bsd,dr->bsr", x, "wkv_a"), "mla_kv")
    latent = rms_norm(kv_a[..., : cfg.kv_lora_rank], p["kv_norm"], eps)
    k_rope = apply_rope(kv_a[..., None, cfg.kv_lora_rank :], *rope)[:, :, 0, :]  # one head, shared
    kv = shard(proj("bsr,rhk->bshk", latent, "wkv_b"), ("batch", "seq", "act_heads", None))
    k_nope, v = kv[..., :nope], kv[..., nope:]

  with jax.named_scope("attention"):
    # Checkpoint names (MaxText/remat.py) for what remat_policy may keep for the backward pass.
    q = checkpoint_name(jnp.concatenate([q_nope, q_rope], axis=-1), "query_proj")
    k = jnp.concatenate(
      [k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1
    )
    k, v = checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
    out = shard(ATTENTION[cfg.attention](q, k, v, softmax_scale(cfg), segment_ids), ("batch", "seq", "act_heads", None))
    out = checkpoint_name(out, "attention_out")

  with jax.named_scope("attention_out"):
    return checkpoint_name(proj("bshk,hkd->bsd", out, "wo"), "out_proj")
