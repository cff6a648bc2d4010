"""One validation phase for every entry point: the trainer, the planner, the converters and the scorer.

Each CLI checks its whole input here before it writes, compiles or prints a status line, so that the
first line a user sees for a bad input is one `error: ...` line (UserError, exit code 2):

  packages(cfg)            optional packages the config turns on (tensorboardX for enable_tensorboard)
  inputs(cfg)              the files a config names: load_parameters_path is a checkpoint step,
                           tokenizer_path / dataset_path exist, a fixed run_name that already
                           finished without checkpoints is not overwritten
  sharding(cfg, ...)       every parameter (and so its AdamW moments, which are sharded like it)
                           and every activation axis against the mesh axes that the logical-axis
                           rules (MaxText/sharding.py: LOGICAL_RULES) map it to; from shapes only
                           (the ParamSpec tree), nothing is compiled. Before JAX starts only the
                           explicit axis sizes are known; the -1 (fill) axes are checked again
                           once the device count is (`devices`)
  backend(cfg, platform)   an explicit expert-GEMM choice that cannot run on the device (a Hopper
                           kernel on a CPU or another GPU): one line naming the choices that can
  devices(cfg, ...)        the mesh for a device count, then sharding and backend for it

Nothing here starts a JAX backend: the callers pass the device count and platform they know (the
planner's --num-gpus, or the devices once jax.distributed has run).
"""

import math
import os
from pathlib import Path

from MaxText.config import Config
from MaxText.errors import UserError

HOPPER_KINDS = ("h100", "h200", "h800", "h20", "gh200")


# ---- the files a config names ----
def _remote(path: str) -> bool:
  return "://" in path


def checkpoint_step_dir(path: str) -> Path:
  """The state directory of a checkpoint step, as checkpointing.load_parameters reads it; UserError if none."""
  p = Path(path).expanduser().absolute()
  if not p.exists():
    raise UserError(
      f"load_parameters_path {path} does not exist; give a checkpoint step directory "
      "(e.g. runs/NAME/checkpoints/1000, or a converted checkpoint's OUT), or leave load_parameters_path empty"
    )
  if (p / "state").is_dir():
    p = p / "state"
  if not (p / "_METADATA").exists():
    raise UserError(
      f"load_parameters_path {path} is not a checkpoint step directory (no state/_METADATA); "
      "name a step directory such as runs/NAME/checkpoints/1000"
    )
  return p


def inputs(cfg: Config) -> None:
  """The paths of a training config: UserError for the first one that cannot work."""
  t, d = cfg.train, cfg.data
  if t.load_parameters_path and not _remote(t.load_parameters_path):
    checkpoint_step_dir(t.load_parameters_path)
  if d.tokenizer_path and not _remote(d.tokenizer_path) and not Path(d.tokenizer_path).expanduser().exists():
    raise UserError(f"tokenizer_path {d.tokenizer_path} does not exist; name the tokenizer file (or its directory)")
  if d.dataset_path and not _remote(d.dataset_path) and not Path(d.dataset_path).expanduser().is_dir():
    raise UserError(f"dataset_path {d.dataset_path} is not a directory; name the TFDS data_dir")
  out = Path(t.base_output_directory).expanduser()
  if not _remote(t.base_output_directory) and out.exists() and not out.is_dir():
    raise UserError(f"base_output_directory {t.base_output_directory} is a file, not a directory; choose another")
  if t.run_name and ("/" in t.run_name or t.run_name in (".", "..")):
    raise UserError(f"run_name={t.run_name!r} must be a plain name (no '/'); base_output_directory sets where it goes")
  if t.run_name and not t.enable_checkpointing and (out / t.run_name / "metrics.jsonl").exists():
    raise UserError(
      f"run directory {out / t.run_name} already holds a run; choose another run_name or remove it "
      "(with enable_checkpointing=true the same run_name resumes)"
    )


# ---- sharding, from shapes ----
def _mesh_sizes(cfg: Config, shape: dict[str, int] | None) -> dict[str, int | None]:
  """Each mesh axis' size: from a resolved shape, else the product of the explicit ici/dcn sizes (None for -1)."""
  from MaxText.sharding import MESH_AXES

  if shape is not None:
    return dict(shape)
  sizes = {}
  for a in MESH_AXES:
    ici, dcn = getattr(cfg.mesh, f"ici_{a}_parallelism"), getattr(cfg.mesh, f"dcn_{a}_parallelism")
    sizes[a] = None if -1 in (ici, dcn) else ici * dcn
  return sizes


def _tensors(cfg: Config, num_devices: int | None):
  """(name, shape, logical axes) of every parameter and of the activations the model constrains."""
  import jax

  from MaxText import model
  from MaxText.params import is_spec

  specs = model.model_specs(cfg.model, cfg.moe)
  for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
    name = "params/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    yield name, spec.shape, spec.axes
  m, t = cfg.model, cfg.train
  b = None if num_devices is None else t.per_device_batch_size * num_devices // t.gradient_accumulation_steps
  s = t.max_target_length
  yield "activations/inputs (microbatch)", (b, s), ("batch", "seq")
  yield (
    "activations/attention query",
    (b, s, m.base_num_query_heads, m.qk_head_dim),
    ("batch", "seq", "act_heads", None),
  )
  if m.first_num_dense_layers:
    yield "activations/dense mlp", (b, s, m.base_mlp_dim), ("batch", "seq", "act_mlp")
  if cfg.moe.shared_experts and m.num_moe_layers:
    width = cfg.moe.base_moe_mlp_dim * cfg.moe.shared_experts
    yield "activations/shared experts mlp", (b, s, width), ("batch", "seq", "act_mlp")


def _divisors(n: int) -> str:
  ds = [d for d in range(1, n + 1) if n % d == 0]
  return ", ".join(map(str, ds[:8])) + (", ..." if len(ds) > 8 else "")


def sharding(cfg: Config, shape: dict[str, int] | None = None, num_devices: int | None = None, where: str = "") -> None:
  """UserError for the first tensor dimension that its mesh axes do not divide.

  `shape` is the resolved mesh (None before the device count is known: then only axes of explicit size count).
  """
  from MaxText.sharding import LOGICAL_RULES

  sizes = _mesh_sizes(cfg, shape)
  for name, dims, axes in _tensors(cfg, num_devices):
    for dim, logical in zip(dims, axes):
      if logical is None or dim is None:
        continue
      mesh_axes = LOGICAL_RULES[logical]
      mesh_axes = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
      if not mesh_axes or any(sizes[a] is None for a in mesh_axes):
        continue
      n = math.prod(sizes[a] for a in mesh_axes)
      if dim % n == 0:
        continue
      used = [a for a in mesh_axes if sizes[a] != 1] or list(mesh_axes)
      keys = "; ".join(_keys_of(cfg, a, sizes[a], num_devices) for a in used)
      over = f" ({' x '.join(f'{a}={sizes[a]}' for a in mesh_axes)} = {n})" if len(mesh_axes) > 1 else ""
      what = "moe_dispatch=" + cfg.moe.moe_dispatch + ": " if logical == "exp" else ""
      filled = [
        a for a in used if -1 in (getattr(cfg.mesh, f"ici_{a}_parallelism"), getattr(cfg.mesh, f"dcn_{a}_parallelism"))
      ]
      if filled:
        other = "ici_data_parallelism=-1" if filled[0] != "data" else "ici_fsdp_parallelism=-1"
        advice = (
          f"run on a device count that gives {filled[0]} a divisor of {dim} ({_divisors(dim)}), or set "
          f"ici_{filled[0]}_parallelism to such a divisor and fill another axis (e.g. {other})"
        )
      else:
        advice = f"use a divisor of {dim} ({_divisors(dim)}) or set -1 with a device count it divides"
      raise UserError(f"{what}{keys} does not divide {logical}={dim} of {name}{over}{where}; {advice}")


def _keys_of(cfg: Config, axis: str, size: int, num_devices: int | None) -> str:
  ici, dcn = (getattr(cfg.mesh, f"{level}_{axis}_parallelism") for level in ("ici", "dcn"))
  parts = [
    f"{level}_{axis}_parallelism={v}"
    for level, v in (("ici", ici), ("dcn", dcn))
    if v != 1 or (level == "ici" and dcn == 1)
  ]
  text = " x ".join(parts)
  if -1 in (ici, dcn):
    text += f" (fills {axis}={size}" + (f" of {num_devices} devices)" if num_devices else ")")
  return text


# ---- expert-GEMM backend per device ----
def _is_hopper_kind(kind: str) -> bool:
  k = kind.lower()
  return any(h in k for h in HOPPER_KINDS)


def runnable_entries(cfg: Config, platform: str, hopper: bool) -> list[str]:
  """`moe_gmm_backend` values that can run this config's quantization on such a device."""
  from MaxText import gmm

  q = cfg.moe.quantization
  out = []
  for e in gmm.EXPERT_GEMMS.values():
    if e.quantization != q or not e.backend or (e.hopper_only and not (platform == "gpu" and hopper)):
      continue
    if gmm.unavailable(e.name):
      continue
    if e.backend == "padded" and cfg.moe.moe_dispatch != "capacity":
      continue
    out.append(e.backend)
  return [*dict.fromkeys(out), "auto"]


def backend(cfg: Config, platform: str | None, device_kind: str = "") -> None:
  """UserError when the configured expert GEMM cannot run on `platform` (cpu | gpu | ...); None = unknown yet."""
  from MaxText import gmm

  moe = cfg.moe
  if platform is None or moe.moe_gmm_backend == "auto":
    return
  impl = moe.mxfp8_impl if moe.mxfp8_impl != "auto" else "emulated"
  name = gmm.entry_name(moe.quantization, moe.moe_gmm_backend, impl)
  entry = gmm.EXPERT_GEMMS.get(name)
  if entry is None:
    return  # config validation names the pair
  hopper = platform == "gpu" and (not device_kind or _is_hopper_kind(device_kind))
  if entry.hopper_only and not hopper:
    on = f"{device_kind} ({platform})" if device_kind and device_kind.lower() != platform else platform
    can = " or ".join(f"moe_gmm_backend={b}" for b in runnable_entries(cfg, platform, hopper))
    q = f" with quantization={moe.quantization}" if moe.quantization else ""
    raise UserError(
      f"moe_gmm_backend={moe.moe_gmm_backend}{q} runs Hopper (sm_90) GPU kernels and cannot run on {on}; "
      f"here choose {can}"
    )
  if problem := gmm.unavailable(name, imports=True):
    raise UserError(f"moe_gmm_backend={moe.moe_gmm_backend}: {name} {problem}")


def planned_platform() -> str | None:
  """The platform JAX will use, when the environment says so before it starts (JAX_PLATFORMS=cpu)."""
  first = (os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME") or "").split(",")[0].strip()
  return {"cuda": "gpu", "rocm": "gpu"}.get(first, first) or None


# ---- the phases ----
def packages(cfg: Config) -> None:
  """Optional packages the config turns on, checked here rather than found missing after the run directory exists."""
  import importlib.util

  if cfg.train.enable_tensorboard and importlib.util.find_spec("tensorboardX") is None:
    raise UserError(
      "enable_tensorboard=true needs tensorboardX, which is not installed here; "
      "pip install tensorboardX, or set enable_tensorboard=false (metrics.jsonl has the same values)"
    )


def before_start(cfg: Config) -> None:
  """Everything that needs no device: paths, packages, the explicit mesh sizes against every tensor, the planned
  platform."""
  inputs(cfg)
  packages(cfg)
  sharding(cfg)
  backend(cfg, planned_platform())


def devices(cfg: Config, num_devices: int, num_slices: int = 1, platform=None, device_kind="", where="") -> dict:
  """The mesh for `num_devices` (UserError if it cannot be made), then sharding and backend for it."""
  from MaxText.sharding import mesh_shape

  shape = mesh_shape(cfg.mesh, num_devices, num_slices)
  sharding(cfg, shape, num_devices, where)
  backend(cfg, platform, device_kind)
  return shape


def parameters_match(path: str, abstract_params) -> None:
  """UserError when the checkpoint at load_parameters_path holds parameters of other shapes or dtypes than the
  model's (read from its metadata only), so that the mismatch stops a run before its directory is written."""
  from MaxText.checkpointing import check_parameters

  if not _remote(path):
    check_parameters(checkpoint_step_dir(path), abstract_params, path)
