"""Model FLOPs per token, counted from the config (the formula is in docs/flops.md).

Training FLOPs per token = 3 x forward FLOPs (forward once, backward twice),
forward = 2 x (weights used per token in matrix products) + causal attention.
Recomputation under remat is not counted: these are model FLOPs, so MFU does
not rise when a run recomputes more.
"""

from MaxText.config_schema import ModelConfig, MoEConfig

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by substring of jax's device_kind.
PEAK_BF16_TFLOPS = {
  "GB300": 2500.0,
  "GB200": 2500.0,
  "B300": 2250.0,
  "B200": 2250.0,
  "H200": 989.0,
  "H100": 989.0,
  "H800": 989.0,
  "H20": 148.0,
  "A100": 312.0,
}


def peak_tflops(device_kind: str, override: float = 0.0) -> float | None:
  if override > 0:
    return override
  for name, peak in PEAK_BF16_TFLOPS.items():
    if name.lower() in device_kind.lower():
      return peak
  return None


def mla_weights(m: ModelConfig) -> int:
  h = m.base_num_query_heads
  q = m.emb_dim * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim if m.q_lora_rank else m.emb_dim * h * m.qk_head_dim
  kv = m.emb_dim * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
  return q + kv + h * m.v_head_dim * m.emb_dim


def moe_active_weights(m: ModelConfig, moe: MoEConfig) -> int:
  expert = 3 * m.emb_dim * moe.base_moe_mlp_dim
  return m.emb_dim * moe.num_experts + expert * (moe.num_experts_per_tok + moe.shared_experts)


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> float:
  """Forward QK^T and PV for one layer; a causal query attends (seq_len + 1) / 2 keys on average."""
  return 2.0 * m.base_num_query_heads * (m.qk_head_dim + m.v_head_dim) * (seq_len + 1) / 2


def active_weights_per_token(m: ModelConfig, moe: MoEConfig) -> int:
  """Weights multiplied per token in one forward pass (embedding lookup excluded)."""
  dense_layer = mla_weights(m) + 3 * m.emb_dim * m.base_mlp_dim
  moe_layer = mla_weights(m) + moe_active_weights(m, moe)
  head = m.emb_dim * m.vocab_size
  mtp_module = 2 * m.emb_dim * m.emb_dim + moe_layer + head
  return m.first_num_dense_layers * dense_layer + m.num_moe_layers * moe_layer + head + m.mtp_num_layers * mtp_module


def training_flops_per_token(m: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
  attention_layers = m.base_num_decoder_layers + m.mtp_num_layers
  forward = 2.0 * active_weights_per_token(m, moe) + attention_layers * attention_flops_per_token(m, seq_len)
  return 3.0 * forward
