"""Typed, read-only config sections; defaults and help text live in configs/base.yml.

Each component receives only its own section (the MoE layer gets `MoEConfig`,
the optimizer `OptimizerConfig`, ...). Key names follow upstream MaxText where
the concept exists there. A field's metadata holds its allowed values
(`choices`) or range (`ge`/`gt`/`le`, and `off`: one more value that means "off" or
"automatic", e.g. -1), or says it is a path (`path`: "required" must not be empty,
"optional" may be "" = none); `config.py` checks them, and `domain()` is the text that
configs/base.yml shows in brackets next to the key (tests/test_validation.py keeps the two alike).
"""

import dataclasses
from dataclasses import dataclass, field


def choice(*options: str):
  return field(metadata={"choices": options})


def at_least(lo, *, strict: bool = False, off=None):
  return field(metadata={"gt" if strict else "ge": lo, **({} if off is None else {"off": off})})


def between(lo, hi):
  return field(metadata={"ge": lo, "le": hi})


def path(required: bool = False):
  """A file-system path: "required" ones must not be empty; optional ones are "" (none) or a path."""
  return field(metadata={"path": "required" if required else "optional"})


def label():
  """A name used in file names (model_name): not empty, no '/'."""
  return field(metadata={"label": True})


def mesh_axis():
  """An ici_*/dcn_* mesh axis size: a positive number of devices, or -1 (the remaining devices)."""
  return at_least(1, off=-1)


def _num(v) -> str:
  return f"{v:g}" if isinstance(v, float) else str(v)


def domain(f: dataclasses.Field) -> str | None:
  """The allowed values of a numeric or path key, as base.yml shows them ([...] after the #); None for others."""
  meta = f.metadata
  if "path" in meta:
    return "path, not empty" if meta["path"] == "required" else 'path or "" (none)'
  if f.type not in (int, float):
    return None
  if "ge" in meta and "le" in meta:
    text = f"{_num(meta['ge'])}..{_num(meta['le'])}"
  elif "ge" in meta:
    text = f">= {_num(meta['ge'])}"
  elif "gt" in meta:
    text = f"> {_num(meta['gt'])}"
  else:
    text = "any integer" if f.type is int else "any number"
  return f"{_num(meta['off'])} or {text}" if "off" in meta else text


def registry_choice(registry: str):
  """Choices that a registry holds, read when a config is checked (config.py: registry_choices), so that an
  entry registered after start-up counts; this module imports none of them."""
  return field(metadata={"registry": registry})


DTYPES = ("float32", "bfloat16", "float16")
# Where a checkpoint-named tensor lives between forward and backward (MaxText/remat.py).
REMAT_LOCATIONS = ("remat", "device", "offload")


def remat_location():
  return field(metadata={"choices": REMAT_LOCATIONS})


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
  model_name: str = label()
  base_emb_dim: int = at_least(1)
  base_num_query_heads: int = at_least(1)
  base_num_kv_heads: int = at_least(1)
  base_mlp_dim: int = at_least(1)
  base_num_decoder_layers: int = at_least(1)
  first_num_dense_layers: int = at_least(0)
  vocab_size: int = at_least(2)
  normalization_layer_epsilon: float = at_least(0.0, strict=True)
  param_init_std: float = at_least(0.0, strict=True)
  logits_dot_in_fp32: bool
  loss_chunk_tokens: int = at_least(0)
  # Multi-head latent attention (DeepSeek-V2/V3).
  q_lora_rank: int = at_least(0)
  kv_lora_rank: int = at_least(1)
  qk_nope_head_dim: int = at_least(1)
  qk_rope_head_dim: int = at_least(2)
  v_head_dim: int = at_least(1)
  rope_type: str = choice("default", "yarn")
  rope_max_timescale: float = at_least(1.0)
  rope_factor: float = at_least(1.0)
  original_max_position_embeddings: int = at_least(1)
  beta_fast: float = at_least(0.0, strict=True)
  beta_slow: float = at_least(0.0, strict=True)
  mscale: float = at_least(0.0)
  attention: str = choice("dot_product", "cudnn_flash")
  # Multi-token prediction (DeepSeek-V3 section 2.2).
  mtp_num_layers: int = at_least(0)
  mtp_loss_scaling_factor: float = at_least(0.0)
  # Numerics and memory.
  dtype: str = choice(*DTYPES)
  weight_dtype: str = choice(*DTYPES)
  scan_layers: bool
  remat_policy: str = choice(
    "full", "minimal", "save_dot_except_mlp", "save_dot_except_moe", "save_qkv_proj", "save_out_proj", "custom", "none"
  )
  # remat_policy=custom: per checkpoint-named tensor, remat | device | offload (MaxText/remat.py).
  decoder_layer_input: str = remat_location()
  mla_q: str = remat_location()
  mla_kv: str = remat_location()
  query_proj: str = remat_location()
  key_proj: str = remat_location()
  value_proj: str = remat_location()
  attention_out: str = remat_location()
  out_proj: str = remat_location()
  mlpwi_0: str = remat_location()
  mlpwi_1: str = remat_location()
  mlpwi: str = remat_location()
  mlpwo: str = remat_location()
  moe_mlpwi_0: str = remat_location()
  moe_mlpwi_1: str = remat_location()
  moe_mlpwo: str = remat_location()

  @property
  def emb_dim(self) -> int:
    return self.base_emb_dim

  @property
  def num_moe_layers(self) -> int:
    return self.base_num_decoder_layers - self.first_num_dense_layers

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
  num_experts: int = at_least(1)
  num_experts_per_tok: int = at_least(1)
  base_moe_mlp_dim: int = at_least(1)
  shared_experts: int = at_least(0)
  routed_score_func: str = choice("sigmoid", "softmax")
  routed_scaling_factor: float = at_least(0.0, strict=True)
  norm_topk_prob: bool
  routed_bias: bool
  routed_bias_update_rate: float = at_least(0.0)
  n_routing_groups: int = at_least(1)
  topk_routing_group: int = at_least(1)
  moe_route_limit_groups: int = at_least(0)
  moe_route_limit_topk_groups: int = at_least(0)
  load_balance_loss_weight: float = at_least(0.0)
  moe_dispatch: str = registry_choice("moe_dispatch")
  capacity_factor: float = at_least(0.0, strict=True, off=-1.0)  # -1 = dropless
  # Expert parallelism (moe_dispatch=ragged_a2a | dense_a2a | allgather; MaxText/moe/ep/).
  moe_dedup: bool
  moe_ep_buffer_factor: float = at_least(0.0, strict=True, off=-1.0)  # -1 = the worst case
  # The expert GEMM: one entry of MaxText/gmm/'s registry for the pair (quantization, moe_gmm_backend).
  moe_gmm_backend: str = registry_choice("moe_gmm_backend")
  quantization: str = registry_choice("quantization")
  mxfp8_impl: str = choice("auto", "block_scaled", "emulated")  # quantization=mxfp8's products
  quantize_before_permute: bool
  quantize_with_activation: bool
  quantize_layers: str  # the layer groups `quantization` applies to (MaxText/layers/linear.py)
  weight_grad_reduce_dtype: str = choice("compute", "float32")  # sharding.gather_weights
  moe_group_pad_multiple: int = at_least(0)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  learning_rate: float = at_least(0.0)
  learning_rate_schedule: str = choice("warmup_cosine", "phases")
  learning_rate_phases: str  # learning_rate_schedule=phases: segments in steps or tokens (MaxText/schedules.py)
  warmup_steps_fraction: float = between(0.0, 1.0)
  learning_rate_schedule_steps: int = at_least(1, off=-1)  # -1 = steps
  cosine_learning_rate_final_fraction: float = between(0.0, 1.0)
  adam_b1: float = between(0.0, 1.0)
  adam_b2: float = between(0.0, 1.0)
  adam_eps: float = at_least(0.0, strict=True)
  adam_weight_decay: float = at_least(0.0)
  gradient_clipping_threshold: float = at_least(0.0)
  mu_dtype: str = choice("", "float32", "bfloat16")
  nu_dtype: str = choice("", "float32", "bfloat16")

  def __post_init__(self):
    from MaxText import schedules

    if self.learning_rate_schedule == "phases" and not self.learning_rate_phases:
      schedules.fail(
        "learning_rate_phases", "learning_rate_schedule=phases needs them, e.g. 'linear 3e-4 for 100 steps; 3e-4'"
      )
    if self.learning_rate_schedule == "phases":
      schedules.check(self.learning_rate_phases, "learning_rate_phases")
    elif self.learning_rate_phases:
      schedules.fail(
        "learning_rate_phases", "acts only with learning_rate_schedule=phases (set it, or leave this empty)"
      )


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
  ici_data_parallelism: int = mesh_axis()
  ici_fsdp_parallelism: int = mesh_axis()
  ici_expert_parallelism: int = mesh_axis()
  ici_tensor_parallelism: int = mesh_axis()
  dcn_data_parallelism: int = mesh_axis()
  dcn_fsdp_parallelism: int = mesh_axis()
  dcn_expert_parallelism: int = mesh_axis()
  dcn_tensor_parallelism: int = mesh_axis()


@dataclass(frozen=True, kw_only=True)
class DataConfig:
  dataset_type: str = choice("synthetic", "tfds", "grain", "hf")
  synthetic_data: str = choice("random", "arithmetic")
  data_shuffle_seed: int = at_least(0)
  enable_data_shuffling: bool
  # Where the documents come from (one of these, by dataset_type).
  dataset_path: str = path()  # tfds: the data_dir holding <name>/<version>/
  dataset_name: str  # tfds: name[:version]
  train_split: str
  grain_train_files: str
  grain_file_type: str = choice("arrayrecord", "parquet", "jsonl", "text")
  hf_path: str
  hf_data_dir: str
  hf_train_files: str
  train_data_columns: str
  # Tokenizing and packing.
  tokenizer_type: str = choice("sentencepiece", "tiktoken", "huggingface")
  tokenizer_path: str = path()
  tokenize_train_data: bool
  add_bos: bool
  add_eos: bool
  packing: bool
  piece_shuffle_window: int = at_least(0)  # 0 = off


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
  run_name: str
  base_output_directory: str = path(required=True)
  per_device_batch_size: int = at_least(1)
  max_target_length: int = at_least(2)
  gradient_accumulation_steps: int = at_least(1)
  # The global batch over the run in sequences, in whole microbatches ("" = per_device_batch_size x devices).
  batch_size_schedule: str
  steps: int = at_least(1)
  # Values scheduled over the run, in steps or tokens ("" = the constant key; MaxText/schedules.py).
  mtp_loss_scaling_factor_schedule: str
  routed_bias_update_rate_schedule: str
  init_weights_seed: int = at_least(0)
  log_period: int = at_least(1)
  enable_tensorboard: bool
  peak_tflops_per_device: float = at_least(0.0)
  compile_heartbeat_seconds: float = at_least(0.0)
  profiler: str = choice("", "xplane")
  skip_first_n_steps_for_profiler: int = at_least(0)
  profiler_steps: int = at_least(1)
  metrics_trace_period: int = at_least(0)  # 0 = off
  # Checkpoints, resume and faults.
  enable_checkpointing: bool
  async_checkpointing: bool
  checkpoint_period: int = at_least(1)
  save_checkpoint_on_completion: bool
  max_num_checkpoints_to_keep: int = at_least(1)
  load_parameters_path: str = path()
  nan_policy: str = choice("stop", "skip")
  # Host offload of the train state (pinned host memory between steps, moved to the device inside the step).
  optimizer_memory_host_offload: bool
  parameter_memory_host_offload: bool
  # The float32 gradient sum of gradient_accumulation_steps microbatches in pinned host memory between them.
  gradient_accumulation_host_offload: bool
  # XLA flags and environment, applied before JAX starts (MaxText/runtime_env.py).
  xla_flag_presets: str
  xla_flags: str
  env_presets: str
  env_vars: str

  def __post_init__(self):
    from MaxText import schedules

    for key in ("mtp_loss_scaling_factor_schedule", "routed_bias_update_rate_schedule"):
      if getattr(self, key):
        schedules.check(getattr(self, key), key)


SECTIONS = {
  "model": ModelConfig,
  "moe": MoEConfig,
  "optimizer": OptimizerConfig,
  "mesh": MeshConfig,
  "data": DataConfig,
  "train": TrainConfig,
}


def key_index() -> dict[str, tuple[str, dataclasses.Field]]:
  """Every valid config key -> (section name, dataclass field)."""
  index = {}
  for section, cls in SECTIONS.items():
    for f in dataclasses.fields(cls):
      assert f.name not in index, f"config key {f.name} is declared twice"
      index[f.name] = (section, f)
  return index
