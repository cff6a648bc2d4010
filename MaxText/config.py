"""Loads a recipe into one validated, read-only `Config`.

Layering, later wins:
  MaxText/configs/base.yml  <  model config (`model_config:`)  <  recipes named by
  `base_config:` (recipes can build on recipes)  <  the recipe  <  CLI `key=value`.

`base_config` and `model_config` are paths, resolved relative to the file that
names them, then relative to the repository root. Every other key must be one
of base.yml's; an unknown key is an error naming the closest valid key, a bad
type or value is an error naming the key and what is allowed.
"""

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from MaxText.config_schema import (
  REMAT_LOCATIONS,
  SECTIONS,
  domain,
  DataConfig,
  MeshConfig,
  ModelConfig,
  MoEConfig,
  OptimizerConfig,
  TrainConfig,
  key_index,
)
from MaxText.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE_YML = Path(__file__).resolve().parent / "configs" / "base.yml"
PATH_KEYS = ("base_config", "model_config")
# Keys that recipes used and that no longer do anything: accepted, with one line saying so.
DEPRECATED = {
  "moe_mosaic_kernels": "moe_gmm_backend=mosaic has one kernel set now (the warp-specialized kernels); "
  "the key is ignored: remove it",
}


@dataclass(frozen=True)
class Config:
  model: ModelConfig
  moe: MoEConfig
  optimizer: OptimizerConfig
  mesh: MeshConfig
  data: DataConfig
  train: TrainConfig
  sources: tuple[str, ...]  # the files that were layered, in order

  def to_flat_dict(self) -> dict[str, Any]:
    flat = {}
    for name in SECTIONS:
      flat.update(dataclasses.asdict(getattr(self, name)))
    return flat

  def to_yaml(self) -> str:
    header = "# Effective config, layered from:\n" + "".join(f"#   {s}\n" for s in self.sources)
    return header + yaml.safe_dump(self.to_flat_dict(), sort_keys=False)


def _read_yaml(path: Path) -> dict[str, Any]:
  if not path.is_file():
    raise UserError(f"config file {path} does not exist")
  try:
    data = yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark else ""
    raise UserError(f"{path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise UserError(f"{path} must hold a mapping of key: value, not a {type(data).__name__}")
  return data


def _resolve(name: str, relative_to: Path, key: str) -> Path:
  for candidate in (Path(name), relative_to.parent / name, REPO_ROOT / name):
    if candidate.is_file():
      return candidate.resolve()
  raise UserError(
    f"{key}: {name} (named in {relative_to}) not found; give a path relative to that file or to {REPO_ROOT}"
  )


def _layers_of(path: Path, seen: tuple[Path, ...] = (), model_only: bool = False) -> list[tuple[Path, dict[str, Any]]]:
  """The files a recipe stands on, lowest first: its base recipes, model config, itself.

  Model configs may build on model configs (base_config) but name no model_config.
  """
  if path in seen:
    raise UserError(f"base_config cycle: {' -> '.join(str(p) for p in (*seen, path))}")
  data = _read_yaml(path)
  layers = []
  if "base_config" in data:
    layers += _layers_of(_resolve(str(data.pop("base_config")), path, "base_config"), (*seen, path), model_only)
  if "model_config" in data:
    if model_only:
      raise UserError(f"{path}: a model config cannot name model_config; use base_config")
    layers += _layers_of(_resolve(str(data.pop("model_config")), path, "model_config"), (*seen, path), model_only=True)
  layers.append((path, data))
  return layers


def _unknown_key(key: str, where: str) -> UserError:
  close = difflib.get_close_matches(key, list(key_index()), n=1, cutoff=0.5)
  hint = f"; did you mean '{close[0]}'?" if close else "; see MaxText/configs/base.yml for the valid keys"
  return UserError(f"unknown config key '{key}' in {where}{hint}")


def registry_choices(registry: str) -> tuple[str, ...]:
  """The values a registry-backed key takes (config_schema.registry_choice), read from the registry itself."""
  if registry == "moe_dispatch":
    from MaxText.moe import dispatch, ep

    return (*dispatch.DISPATCHERS, *ep.BACKENDS)
  from MaxText import gmm

  return {"moe_gmm_backend": gmm.backends, "quantization": gmm.quantizations}[registry]()


def _typed(key: str, value: Any, f: dataclasses.Field, where: str) -> Any:
  kind = f.type
  meta = f.metadata
  if kind is bool:
    if not isinstance(value, bool):
      raise UserError(f"{key}={value!r} (from {where}) must be true or false")
  elif kind is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise UserError(f"{key}={value!r} (from {where}) must be an integer")
  elif kind is float:
    if isinstance(value, str):
      try:
        value = float(value)
      except ValueError:
        raise UserError(f"{key}={value!r} (from {where}) must be a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise UserError(f"{key}={value!r} (from {where}) must be a finite number")
    value = float(value)
  elif kind is str:
    if not isinstance(value, str):
      raise UserError(f"{key}={value!r} (from {where}) must be a string")
  choices = registry_choices(meta["registry"]) if "registry" in meta else meta.get("choices")
  if choices is not None and value not in choices:
    shown = ", ".join(c if c else '"" (off)' for c in choices)
    raise UserError(f"{key}={value!r} (from {where}) is not allowed; choose one of: {shown}")
  if meta.get("label") and (not value.strip() or "/" in value):
    raise UserError(f"{key}={value!r} (from {where}) must be a non-empty name without '/'")
  if "path" in meta:
    if meta["path"] == "required" and not value.strip():
      default = _read_yaml(BASE_YML).get(key)
      raise UserError(f"{key} (from {where}) is empty; it must name a directory (the default is {default!r})")
    if value != value.strip():
      raise UserError(f"{key}={value!r} (from {where}) has spaces at an end; write the path without them")
  if "off" in meta and value == meta["off"]:
    return value
  if any(k in meta for k in ("ge", "gt", "le")):
    lo_ok = not ("ge" in meta and value < meta["ge"]) and not ("gt" in meta and value <= meta["gt"])
    if not lo_ok or ("le" in meta and value > meta["le"]):
      shown = domain(f)
      raise UserError(f"{key}={value!r} (from {where}) must be {'in ' if '..' in shown else ''}{shown}")
  return value


def parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
  overrides = []
  for arg in argv:
    key, sep, text = arg.partition("=")
    if not sep or not key:
      raise UserError(f"command-line argument '{arg}' must be key=value")
    try:
      value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
      value = text
    overrides.append((key.strip(), value))
  return overrides


def load_config(recipe: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """base.yml, then the recipe and everything it names, then `key=value` overrides."""
  index = key_index()
  layers = [(BASE_YML, _read_yaml(BASE_YML))]
  if recipe is not None:
    layers += _layers_of(Path(recipe).resolve())
  layers.append(("the command line", dict(parse_overrides(list(overrides)))))

  values: dict[str, Any] = {}
  origin: dict[str, str] = {}
  for path, data in layers:
    where = str(path)
    for key, value in data.items():
      if key in PATH_KEYS:
        raise UserError(f"{key} can only be set in a recipe file, not in {where}")
      if key in DEPRECATED:
        print(f"warning: {key} (from {where}) is deprecated: {DEPRECATED[key]}", file=sys.stderr)
        continue
      if key not in index:
        raise _unknown_key(key, where)
      values[key] = _typed(key, value, index[key][1], where)
      origin[key] = where

  missing = sorted(set(index) - set(values))
  if missing:  # base.yml must give every key a default; tests/test_config.py checks it
    raise UserError(f"{BASE_YML} has no default for: {', '.join(missing)}")

  sections = {name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)}) for name, cls in SECTIONS.items()}
  cfg = Config(**sections, sources=tuple(str(p) for p, _ in layers[:-1]))
  _check_consistency(cfg, origin)
  return cfg


def _check_consistency(cfg: Config, origin: dict[str, str]) -> None:
  m, moe, t, d = cfg.model, cfg.moe, cfg.train, cfg.data

  def fail(key: str, msg: str):
    raise UserError(f"{key}: {msg} (set in {origin[key]})")

  if m.first_num_dense_layers > m.base_num_decoder_layers:
    fail(
      "first_num_dense_layers",
      f"{m.first_num_dense_layers} is more than base_num_decoder_layers={m.base_num_decoder_layers}",
    )
  if m.base_num_kv_heads != m.base_num_query_heads:
    fail(
      "base_num_kv_heads",
      f"MLA has one kv head per query head; set it to base_num_query_heads={m.base_num_query_heads}",
    )
  if m.qk_rope_head_dim % 2:
    fail("qk_rope_head_dim", f"{m.qk_rope_head_dim} must be even (rotary pairs)")
  if moe.num_experts_per_tok > moe.num_experts:
    fail("num_experts_per_tok", f"{moe.num_experts_per_tok} is more than num_experts={moe.num_experts}")
  if moe.num_experts % moe.n_routing_groups:
    fail("n_routing_groups", f"num_experts={moe.num_experts} is not divisible by {moe.n_routing_groups} groups")
  if moe.topk_routing_group > moe.n_routing_groups:
    fail("topk_routing_group", f"{moe.topk_routing_group} is more than n_routing_groups={moe.n_routing_groups}")
  per_group = moe.num_experts // moe.n_routing_groups
  if moe.n_routing_groups > 1 and per_group < 2:
    fail(
      "n_routing_groups", f"group scores sum each group's top-2 experts, so groups need >= 2 experts (have {per_group})"
    )
  if moe.topk_routing_group * per_group < moe.num_experts_per_tok:
    fail(
      "topk_routing_group",
      f"{moe.topk_routing_group} groups of {per_group} experts cannot supply "
      f"num_experts_per_tok={moe.num_experts_per_tok}",
    )
  _check_route_limit(moe, fail)
  if moe.moe_group_pad_multiple and moe.moe_dispatch != "sort":
    fail(
      "moe_group_pad_multiple",
      f"pads the dropless groups of moe_dispatch=sort; moe_dispatch={moe.moe_dispatch} has fixed-size groups (set 0)",
    )
  if moe.moe_dispatch == "capacity" and moe.capacity_factor <= 0:
    fail("capacity_factor", "moe_dispatch=capacity needs capacity_factor > 0 (e.g. 1.25)")
  if moe.moe_dispatch == "sort" and moe.capacity_factor > 0:
    fail("capacity_factor", "moe_dispatch=sort is dropless; set capacity_factor=-1 or choose moe_dispatch=capacity")
  _check_expert_parallel(cfg, fail)
  if moe.moe_gmm_backend == "padded" and moe.moe_dispatch != "capacity":
    fail("moe_gmm_backend", "padded runs equal-capacity groups; set moe_dispatch=capacity (and capacity_factor)")
  if moe.moe_gmm_backend == "mosaic" and m.dtype not in ("bfloat16", "float16"):
    fail(
      "moe_gmm_backend",
      f"mosaic runs bf16/fp16 Hopper (sm_90) GPU kernels, not dtype={m.dtype}; set moe_gmm_backend=xla "
      "(any device and dtype) or auto, or on an H100/H200 dtype=bfloat16",
    )
  from MaxText import gmm

  if why := gmm.check(moe.quantization, moe.moe_gmm_backend, moe.mxfp8_impl):
    fail("mxfp8_impl" if why.startswith("mxfp8_impl") else "quantization", why)
  from MaxText.layers import linear

  try:
    linear.parse_groups(moe.quantize_layers)
  except ValueError as e:
    fail("quantize_layers", str(e).split(": ", 1)[1])
  if t.per_device_batch_size % t.gradient_accumulation_steps:
    fail(
      "gradient_accumulation_steps",
      f"per_device_batch_size={t.per_device_batch_size} is not divisible by {t.gradient_accumulation_steps}",
    )
  if t.gradient_accumulation_host_offload and t.gradient_accumulation_steps == 1:
    fail("gradient_accumulation_host_offload", "there is no gradient sum with gradient_accumulation_steps=1")
  if t.batch_size_schedule:
    from MaxText import schedules

    try:
      schedules.check_batch(t.batch_size_schedule, "batch_size_schedule")
    except UserError as e:
      fail("batch_size_schedule", str(e).removeprefix("batch_size_schedule: "))
  if cfg.optimizer.learning_rate_schedule_steps == 0 or cfg.optimizer.learning_rate_schedule_steps < -1:
    fail("learning_rate_schedule_steps", "must be -1 (use steps) or a positive number of steps")
  _check_remat(m, origin, fail)
  _check_runtime_env(t, fail)
  _check_data(d, m, fail)


def _check_route_limit(moe, fail) -> None:
  """Rank-limited routing: M of G contiguous expert groups must always hold k allowed experts."""
  g, m, k = moe.moe_route_limit_groups, moe.moe_route_limit_topk_groups, moe.num_experts_per_tok
  if g == 0:
    if m:
      fail("moe_route_limit_topk_groups", f"{m} needs moe_route_limit_groups > 0 (rank-limited routing is off)")
    return
  if moe.num_experts % g:
    fail("moe_route_limit_groups", f"num_experts={moe.num_experts} is not divisible by {g} groups")
  if not 1 <= m <= g:
    fail("moe_route_limit_topk_groups", f"must be between 1 and moe_route_limit_groups={g} (is {m})")
  per_group = moe.num_experts // g
  if m * per_group < k:
    fail("moe_route_limit_topk_groups", f"{m} groups of {per_group} experts cannot supply num_experts_per_tok={k}")
  n = moe.n_routing_groups
  if n == 1:
    return
  if g % n and n % g:
    fail("moe_route_limit_groups", f"{g} groups must nest with n_routing_groups={n} (one must divide the other)")
  if n > g:  # each rank group holds n/g routing groups; in the worst case the kept ones are spread evenly
    kept = moe.topk_routing_group
    fewest = m * (kept // g) + min(m, kept % g)  # kept routing groups inside the best m rank groups
    if fewest * (moe.num_experts // n) < k:
      fail(
        "moe_route_limit_topk_groups",
        f"{m} of {g} groups may hold only {fewest} of the topk_routing_group={kept} routing groups, "
        f"fewer than num_experts_per_tok={k} experts",
      )


def _check_expert_parallel(cfg: Config, fail) -> None:
  """moe_dispatch over the mesh axis expert (MaxText/moe/ep/): dropless, its backend present, experts divisible."""
  from MaxText.moe import ep

  moe, mesh = cfg.moe, cfg.mesh
  if moe.moe_ep_buffer_factor != -1 and moe.moe_ep_buffer_factor <= 0:
    fail(
      "moe_ep_buffer_factor",
      f"{moe.moe_ep_buffer_factor}: must be -1 (worst case) or > 0 (a multiple of the balanced share)",
    )
  if not ep.is_ep(moe.moe_dispatch):
    return
  if moe.capacity_factor > 0:
    fail(
      "capacity_factor",
      f"moe_dispatch={moe.moe_dispatch} is dropless; set capacity_factor=-1 "
      "(size its buffers with moe_ep_buffer_factor)",
    )
  size = mesh.ici_expert_parallelism * mesh.dcn_expert_parallelism
  if mesh.ici_expert_parallelism > 0 and mesh.dcn_expert_parallelism > 0 and moe.num_experts % size:
    fail("ici_expert_parallelism", f"num_experts={moe.num_experts} is not divisible by the expert-parallel size {size}")


def _check_data(d, m, fail) -> None:
  """Real datasets: the keys each dataset_type needs (files themselves are checked when the data is opened)."""
  if d.dataset_type == "synthetic":
    return
  needs = {"tfds": "dataset_name", "grain": "grain_train_files", "hf": "hf_path"}[d.dataset_type]
  if not getattr(d, needs):
    fail(needs, f"dataset_type={d.dataset_type} needs {needs}")
  if d.tokenize_train_data and not d.tokenizer_path:
    fail(
      "tokenizer_path",
      f"dataset_type={d.dataset_type} needs a tokenizer file (or tokenize_train_data=false for token-id columns)",
    )
  if d.dataset_type in ("tfds", "hf") and not d.train_split:
    fail("train_split", f"dataset_type={d.dataset_type} reads a split; name it (e.g. train)")
  if not d.train_data_columns:
    fail("train_data_columns", "name the column that holds the documents")
  if d.packing and m.attention != "dot_product":
    fail(
      "packing",
      f"packed rows need segment-aware attention: set attention=dot_product (not {m.attention}) or packing=false",
    )


def _check_remat(m, origin: dict[str, str], fail) -> None:
  """Per-tensor remat keys act only under remat_policy=custom, and each must name a tensor the model has."""
  keys = [f.name for f in dataclasses.fields(m) if f.metadata.get("choices") == REMAT_LOCATIONS]
  if m.remat_policy != "custom":
    defaults = _read_yaml(BASE_YML)
    for key in keys:
      if getattr(m, key) != defaults[key]:
        fail(key, f"per-tensor remat keys act only with remat_policy=custom (remat_policy is {m.remat_policy})")
    return
  if m.q_lora_rank == 0 and m.mla_q != "remat":
    fail("mla_q", "there is no low-rank query with q_lora_rank=0; leave mla_q=remat")


def _check_runtime_env(t, fail) -> None:
  """Preset names and the syntax of xla_flags/env_vars; the flags themselves are checked against jaxlib at start."""
  from MaxText import runtime_env

  for key in ("xla_flag_presets", "xla_flags", "env_presets", "env_vars"):
    try:
      runtime_env.parse_key(key, getattr(t, key))
    except UserError as e:
      fail(key, str(e))
