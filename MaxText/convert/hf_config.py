"""The Hugging Face DeepSeek-V3 `config.json` in our config keys, and back.

Only DeepseekV3ForCausalLM as `transformers` computes it is accepted: sigmoid
router scores with the `e_score_correction_bias` (noaux_tc), SiLU experts,
untied embeddings, no attention bias. A field we cannot express is a UserError
naming it, never a silent approximation. YaRN maps as transformers applies it:
`mscale_all_dim` sets the softmax-scale correction (our `mscale`); the cos/sin
`attention_factor` (mscale / mscale_all_dim) must be 1, as in DeepSeek-V3,
because our rotary embedding has no such factor.
"""

import json
import math
from pathlib import Path
from typing import Any

from MaxText.config_schema import ModelConfig, MoEConfig
from MaxText.errors import UserError

ARCHITECTURE = "DeepseekV3ForCausalLM"
CONFIG_FILE = "config.json"
# A field config.json leaves out takes transformers' DeepseekV3Config default, as transformers would.
HF_DEFAULTS = {
  "vocab_size": 129280,
  "hidden_size": 7168,
  "intermediate_size": 18432,
  "moe_intermediate_size": 2048,
  "num_hidden_layers": 61,
  "num_attention_heads": 128,
  "num_key_value_heads": None,
  "n_shared_experts": 1,
  "n_routed_experts": 256,
  "routed_scaling_factor": 2.5,
  "kv_lora_rank": 512,
  "q_lora_rank": 1536,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "qk_nope_head_dim": 128,
  "n_group": 8,
  "topk_group": 4,
  "num_experts_per_tok": 8,
  "first_k_dense_replace": 3,
  "norm_topk_prob": True,
  "hidden_act": "silu",
  "max_position_embeddings": 4096,
  "rms_norm_eps": 1e-6,
  "tie_word_embeddings": False,
  "attention_bias": False,
  "rope_theta": 10000.0,
  "rope_interleave": True,
  "scoring_func": "sigmoid",
  "topk_method": "noaux_tc",
}


def read(hf_dir: Path) -> dict:
  path = hf_dir / CONFIG_FILE
  if not hf_dir.is_dir():
    raise UserError(f"--hf-dir {hf_dir} is not a directory")
  if not path.is_file():
    raise UserError(
      f"{path} does not exist; a Hugging Face checkpoint directory holds config.json and *.safetensors shards"
    )
  try:
    cfg = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}") from None
  if not isinstance(cfg, dict):
    raise UserError(f"{path} must hold a JSON object")
  archs = cfg.get("architectures") or []
  if ARCHITECTURE not in archs:
    named = ", ".join(map(str, archs)) or "(none given)"
    raise UserError(f"{path}: unsupported architecture {named}; only {ARCHITECTURE} checkpoints convert")
  return cfg


def field(hf: dict, key: str, required: bool = True) -> Any:
  value = hf[key] if key in hf else HF_DEFAULTS[key]
  if value is None and required:
    raise UserError(f"config.json: {key} is null")
  return value


def _yarn_mscale(factor: float, mscale: float) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_keys(hf: dict) -> dict[str, Any]:
  """Our rope keys from `rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta` (the release)."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if any(isinstance(v, dict) for v in params.values()):
    raise UserError("config.json: per-layer-type rope parameters are not supported")
  theta = float(params.get("rope_theta") or field(hf, "rope_theta"))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return {"rope_type": "default", "rope_max_timescale": theta, "rope_factor": 1.0}
  if kind != "yarn":
    raise UserError(f"config.json: rope type {kind!r} is not supported; DeepSeek-V3 uses yarn (or default)")
  original = params.get("original_max_position_embeddings") or field(hf, "max_position_embeddings")
  factor = float(params.get("factor") or field(hf, "max_position_embeddings") / original)
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  attention_factor = params.get("attention_factor")
  if attention_factor is None:  # transformers' _compute_yarn_parameters
    both = mscale and mscale_all_dim
    attention_factor = (
      _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if both else _yarn_mscale(factor, 1.0)
    )
  if abs(attention_factor - 1.0) > 1e-12:
    raise UserError(
      f"config.json: YaRN attention_factor {attention_factor:.6g} (from factor={factor}, mscale={mscale}, "
      f"mscale_all_dim={mscale_all_dim}) is not supported; our rotary embedding has no cos/sin scale, "
      "so mscale must equal mscale_all_dim, as in DeepSeek-V3"
    )
  if params.get("truncate", True) is False:
    raise UserError("config.json: YaRN truncate=false is not supported")
  return {
    "rope_type": "yarn",
    "rope_max_timescale": theta,
    "rope_factor": factor,
    "original_max_position_embeddings": int(original),
    "beta_fast": float(params.get("beta_fast") or 32),
    "beta_slow": float(params.get("beta_slow") or 1),
    "mscale": float(mscale_all_dim or 0.0),
  }


def to_model_keys(hf: dict, *, model_name: str, mtp_layers: int) -> dict[str, Any]:
  """Our model and MoE keys (those a model config sets) for a DeepSeek-V3 config.json."""
  for key in ("hidden_act", "tie_word_embeddings", "attention_bias", "scoring_func", "topk_method"):
    if field(hf, key, required=False) != HF_DEFAULTS[key]:
      raise UserError(
        f"config.json: {key}={json.dumps(hf[key])} is not supported; DeepSeek-V3 has {json.dumps(HF_DEFAULTS[key])}"
      )
  if hf.get("moe_layer_freq", 1) != 1:  # DeepSeek's own code: MoE where layer % freq == 0; transformers: every layer
    raise UserError(
      f"config.json: moe_layer_freq={hf['moe_layer_freq']} is not supported; DeepSeek-V3 has 1 "
      "(every layer after the dense ones is MoE)"
    )
  heads = field(hf, "num_attention_heads")
  if field(hf, "num_key_value_heads", required=False) not in (None, heads):
    raise UserError(
      f"config.json: num_key_value_heads={hf['num_key_value_heads']} must equal num_attention_heads={heads} "
      "(MLA has one kv head per query head)"
    )
  layers = field(hf, "num_hidden_layers")
  keys = {
    "model_name": model_name,
    "base_emb_dim": field(hf, "hidden_size"),
    "base_num_query_heads": heads,
    "base_num_kv_heads": heads,
    "base_mlp_dim": field(hf, "intermediate_size"),
    "base_num_decoder_layers": layers,
    "first_num_dense_layers": min(field(hf, "first_k_dense_replace", required=False) or 0, layers),
    "vocab_size": field(hf, "vocab_size"),
    "normalization_layer_epsilon": float(field(hf, "rms_norm_eps")),
    "q_lora_rank": field(hf, "q_lora_rank", required=False) or 0,  # null: a full-rank query
    "kv_lora_rank": field(hf, "kv_lora_rank"),
    "qk_nope_head_dim": field(hf, "qk_nope_head_dim"),
    "qk_rope_head_dim": field(hf, "qk_rope_head_dim"),
    "v_head_dim": field(hf, "v_head_dim"),
    **rope_keys(hf),
    "mtp_num_layers": mtp_layers,
    "num_experts": field(hf, "n_routed_experts"),
    "num_experts_per_tok": field(hf, "num_experts_per_tok"),
    "base_moe_mlp_dim": field(hf, "moe_intermediate_size"),
    "shared_experts": field(hf, "n_shared_experts", required=False) or 0,
    "routed_score_func": "sigmoid",
    "routed_scaling_factor": float(field(hf, "routed_scaling_factor")),
    "norm_topk_prob": bool(field(hf, "norm_topk_prob")),
    "routed_bias": True,  # transformers always adds e_score_correction_bias for the choice
    "n_routing_groups": field(hf, "n_group", required=False) or 1,
    "topk_routing_group": field(hf, "topk_group", required=False) or 1,
  }
  return keys


def rope_interleave(hf: dict | None) -> bool:
  """True: the rotary dims of q and k are stored as adjacent pairs (the release; our layout)."""
  return bool(field(hf or {}, "rope_interleave"))


def from_model_config(m: ModelConfig, moe: MoEConfig, base: dict | None, dtype: str) -> dict:
  """config.json for our model: `base` (the source config.json, when known) with every mapped field rewritten."""
  hf = dict(base or {})
  for stale in ("quantization_config", "rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype"):
    hf.pop(stale, None)  # the weights come out dequantised; rope and dtype are rewritten below
  first_k = (base or {}).get("first_k_dense_replace")
  if first_k is None or min(first_k, m.base_num_decoder_layers) != m.first_num_dense_layers:
    first_k = m.first_num_dense_layers
  rope = {
    "rope_type": "yarn",
    "factor": m.rope_factor,
    "original_max_position_embeddings": m.original_max_position_embeddings,
    "beta_fast": m.beta_fast,
    "beta_slow": m.beta_slow,
    "mscale": m.mscale,
    "mscale_all_dim": m.mscale,
  }
  dtype_key = "torch_dtype" if base and "torch_dtype" in base and "dtype" not in base else "dtype"
  hf.update(
    {
      "architectures": [ARCHITECTURE],
      "model_type": "deepseek_v3",
      "vocab_size": m.vocab_size,
      "hidden_size": m.emb_dim,
      "intermediate_size": m.base_mlp_dim,
      "moe_intermediate_size": moe.base_moe_mlp_dim,
      "num_hidden_layers": m.base_num_decoder_layers,
      "num_nextn_predict_layers": m.mtp_num_layers,
      "num_attention_heads": m.base_num_query_heads,
      "num_key_value_heads": m.base_num_query_heads,
      "n_shared_experts": moe.shared_experts,
      "n_routed_experts": moe.num_experts,
      "routed_scaling_factor": moe.routed_scaling_factor,
      "kv_lora_rank": m.kv_lora_rank,
      "q_lora_rank": m.q_lora_rank or None,
      "qk_rope_head_dim": m.qk_rope_head_dim,
      "v_head_dim": m.v_head_dim,
      "qk_nope_head_dim": m.qk_nope_head_dim,
      "n_group": moe.n_routing_groups,
      "topk_group": moe.topk_routing_group,
      "num_experts_per_tok": moe.num_experts_per_tok,
      "first_k_dense_replace": first_k,
      "norm_topk_prob": moe.norm_topk_prob,
      "scoring_func": "sigmoid",
      "topk_method": "noaux_tc",
      "hidden_act": "silu",
      "rms_norm_eps": m.normalization_layer_epsilon,
      "tie_word_embeddings": False,
      "attention_bias": False,
      "rope_theta": m.rope_max_timescale,
      "rope_interleave": rope_interleave(base),
      dtype_key: dtype,
    }
  )
  if m.rope_type == "yarn":
    hf["rope_scaling"] = rope  # the release's spelling; transformers >= 5 reads it as rope_parameters
  hf.setdefault(
    "max_position_embeddings", m.original_max_position_embeddings * (int(m.rope_factor) if m.rope_type == "yarn" else 1)
  )
  return hf
