"""XLA flags and process environment for a run, chosen by name in a recipe and set before JAX starts.

  xla_flag_presets: "latency_hiding,pipelined_collectives"   # names from XLA_PRESETS below
  xla_flags: "--xla_gpu_enable_command_buffer="             # raw flags, after the presets
  env_presets: "mem_fraction_95"                             # names from ENV_PRESETS below
  env_vars: "NCCL_DEBUG=WARN"                                # raw NAME=VALUE, after the presets

XLA reads XLA_FLAGS, and the CUDA client its XLA_PYTHON_CLIENT_* / CUDA_* / NCCL_* variables,
once, when the backend starts; so `apply` runs in train.main before anything touches a JAX
backend, and refuses if one is already up. Every flag (the configured ones and any already in
XLA_FLAGS) is first checked against the flag names compiled into the installed jaxlib and CUDA
plugin (MaxText/xla_flags.py): XLA aborts on unknown flags, we stop with one line naming the
flag and the jaxlib version (UserError, exit code 2). For the same flag, later wins: XLA_FLAGS
from the environment < presets in the order named < xla_flags.

Preset contents are flag names of jaxlib 0.11.2 (tests/test_xla_flags.py checks each against
the installed jaxlib and the CUDA plugin). Nothing here imports jax.
"""

import os
import re
import shlex
import sys

from MaxText import xla_flags
from MaxText.errors import UserError

_128_MIB = str(128 * 2**20)

# name -> (what it is for, flags). All are GPU flags: on CPU they parse but do nothing.
XLA_PRESETS = {
  "latency_hiding": (
    "schedule async collectives and host copies to overlap compute",
    ("--xla_gpu_enable_latency_hiding_scheduler=true",),
  ),
  "multi_stream_collectives": (
    "several communication streams, and the async stream at top priority",
    (
      "--xla_gpu_experimental_enable_collective_multi_streaming=true",
      "--xla_gpu_enable_highest_priority_async_stream=true",
    ),
  ),
  "pipelined_collectives": (
    "FSDP: all-gather the next layer's weights / reduce-scatter the last one's grads inside the layer loop",
    (
      "--xla_gpu_enable_pipelined_all_gather=true",
      "--xla_gpu_enable_pipelined_reduce_scatter=true",
      "--xla_gpu_enable_pipelined_all_reduce=true",
    ),
  ),
  "collective_combine": (
    "combine small collectives up to 128 MiB each",
    (
      f"--xla_gpu_all_gather_combine_threshold_bytes={_128_MIB}",
      f"--xla_gpu_reduce_scatter_combine_threshold_bytes={_128_MIB}",
      f"--xla_gpu_all_reduce_combine_threshold_bytes={_128_MIB}",
    ),
  ),
  "command_buffers": (
    "CUDA graphs for fusions, cuBLAS, cuDNN and custom calls: fewer kernel launches",
    ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",),
  ),
  "no_command_buffers": (
    "no CUDA graphs: every kernel launched (and profiled) on its own",
    ("--xla_gpu_enable_command_buffer=",),
  ),
}

# name -> (what it is for, variables).
ENV_PRESETS = {
  "mem_fraction_95": (
    "let the JAX GPU allocator take 95% of device memory (default 75%)",
    {
      "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95",
    },
  ),
  "cuda_single_queue": (
    "one hardware queue: kernels start in launch order (not advised on Blackwell)",
    {
      "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    },
  ),
  "nccl_no_nvls": (
    "no NVLink SHARP in NCCL",
    {
      "NCCL_NVLS_ENABLE": "0",
    },
  ),
  "nccl_debug": (
    "NCCL logs its set-up and its environment",
    {
      "NCCL_DEBUG": "INFO",
      "NCCL_DEBUG_SUBSYS": "INIT,ENV",
    },
  ),
}

_FLAG = re.compile(r"--(xla_[a-z0-9_]+)(?:=(.*))?$", re.S)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
# What the run directory and the log record as "the environment in force".
RECORDED_PREFIXES = ("XLA_", "CUDA_", "NCCL_", "JAX_", "TF_GPU_", "NVIDIA_TF32")


def _names(text: str) -> list[str]:
  return [n.strip() for n in text.split(",") if n.strip()]


def _error(where: str | None, msg: str) -> UserError:
  return UserError(f"{where}: {msg}" if where else msg)


def parse_flags(text: str, where: str | None) -> list[tuple[str, str]]:
  """'--xla_a=1 --xla_b' -> [('xla_a', '--xla_a=1'), ('xla_b', '--xla_b')]."""
  try:
    tokens = shlex.split(text)
  except ValueError as e:
    raise _error(where, f"cannot split {text!r}: {e}") from None
  flags = []
  for tok in tokens:
    m = _FLAG.match(tok)
    if not m:
      raise _error(where, f"'{tok}' is not an XLA flag; write --xla_name=value")
    if any(c.isspace() for c in tok):
      raise _error(where, f"'{tok}': XLA_FLAGS cannot carry a value with spaces")
    flags.append((m.group(1), tok))
  return flags


def parse_env(text: str, where: str | None) -> dict[str, str]:
  try:
    tokens = shlex.split(text)
  except ValueError as e:
    raise _error(where, f"cannot split {text!r}: {e}") from None
  env = {}
  for tok in tokens:
    name, sep, value = tok.partition("=")
    if not sep or not _ENV_NAME.match(name):
      raise _error(where, f"'{tok}' is not NAME=VALUE")
    if name == "XLA_FLAGS":
      raise _error(where, "set XLA flags with xla_flags or xla_flag_presets, not XLA_FLAGS")
    env[name] = value
  return env


def parse_key(key: str, value: str):
  """Checks one config key's syntax and preset names (config loading calls this); returns it parsed."""
  if key in ("xla_flag_presets", "env_presets"):
    table = XLA_PRESETS if key == "xla_flag_presets" else ENV_PRESETS
    for name in _names(value):
      if name not in table:
        raise UserError(f"unknown preset '{name}'; choose from: {', '.join(table)}")
    return _names(value)
  if key == "xla_flags":
    return parse_flags(value, None)
  return parse_env(value, None)


def planned(train_cfg, environ=None) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
  """([(flag name, token, where it came from)] in order, later wins; {env name: value}) for a TrainConfig."""
  environ = os.environ if environ is None else environ
  flags = [
    (n, tok, "the XLA_FLAGS environment variable") for n, tok in parse_flags(environ.get("XLA_FLAGS", ""), "XLA_FLAGS")
  ]
  for preset in parse_key("xla_flag_presets", train_cfg.xla_flag_presets):
    flags += [
      (n, tok, f"xla_flag_presets {preset}") for n, tok in parse_flags(" ".join(XLA_PRESETS[preset][1]), preset)
    ]
  flags += [(n, tok, "xla_flags") for n, tok in parse_key("xla_flags", train_cfg.xla_flags)]
  env = {}
  for preset in parse_key("env_presets", train_cfg.env_presets):
    env.update(ENV_PRESETS[preset][1])
  env.update(parse_key("env_vars", train_cfg.env_vars))
  return flags, env


def validate(flags: list[tuple[str, str, str]], libs=None, probe: bool | None = None) -> list[str]:
  """Raises UserError on the first flag a library does not know; returns notes (GPU flags without a GPU plugin).

  Names are first looked up in the libraries' flag names (fast, cached); then, with `probe` (the default
  when `libs` are the installed ones), XLA itself is asked in a subprocess (xla_flags.probe), which also
  refuses flags whose name is still in the library but no longer accepted, and values it cannot read.
  """
  probe = libs is None if probe is None else probe
  libs = xla_flags.libraries() if libs is None else libs
  if not libs:
    raise UserError("cannot find the jaxlib library to check XLA flags against; is jaxlib installed?")
  for name, _, where in flags:
    lib = xla_flags.unknown(name, libs)
    if lib is not None:
      raise UserError(
        f"XLA flag --{name} (from {where}) is not known to {lib.label} ({lib.path.name}); "
        "XLA would abort on it: remove it or use the name this version has"
      )
  if probe and flags:
    _probe(flags, next((lib for lib in libs if lib.label.startswith("jaxlib")), libs[0]))
  notes = []
  has_gpu_plugin = any(not lib.label.startswith("jaxlib") for lib in libs)
  gpu_sources = list(dict.fromkeys(where for name, _, where in flags if name.startswith("xla_gpu_")))
  if gpu_sources and not has_gpu_plugin:
    notes.append(
      f"GPU flags from {', '.join(gpu_sources)} but no CUDA plugin is installed: jax runs on CPU, where they do nothing"
    )
  return notes


def _probe(flags: list[tuple[str, str, str]], lib) -> None:
  """UserError for the first flag that XLA itself refuses (the flags as XLA_FLAGS will hold them)."""
  merged: dict[str, tuple[str, str]] = {}
  for name, tok, where in flags:
    merged.pop(name, None)
    merged[name] = (tok, where)
  refused = xla_flags.probe([tok for tok, _ in merged.values()])
  for name, why in refused or ():
    tok, where = merged.get(name, (f"--{name}", "XLA_FLAGS"))
    if why == "unknown":
      raise UserError(
        f"XLA flag --{name} (from {where}) is not known to {lib.label} ({lib.path.name}); "
        "XLA would abort on it: remove it or use the name this version has"
      )
    raise UserError(
      f"XLA flag {tok} (from {where}): {lib.label} cannot read this value; XLA would abort on it: "
      "fix the value (true/false, a number, or one of the flag's names)"
    )


def _backend_started() -> bool:
  bridge = sys.modules.get("jax._src.xla_bridge")
  return bool(bridge is not None and getattr(bridge, "_backends", None))


def _merged(xla_flags: str) -> str:
  """XLA_FLAGS with each flag once, at its last position, holding its last value (how XLA reads them)."""
  merged: dict[str, str] = {}
  for tok in xla_flags.split():
    name = tok.lstrip("-").split("=", 1)[0]
    merged.pop(name, None)
    merged[name] = tok
  return " ".join(merged.values())


def apply(train_cfg) -> dict:
  """Validates the configured flags and environment and sets them in os.environ; JAX must not have started.

  Returns what was set: {"xla_flags": str, "env": {name: value}, "notes": [str]}.
  """
  flags, env = planned(train_cfg)
  notes = validate(flags)
  merged: dict[str, str] = {}
  for name, tok, _ in flags:
    merged.pop(name, None)  # later wins, and takes the later position
    merged[name] = tok
  xla = " ".join(merged.values())
  changes = dict(env)
  if xla != _merged(os.environ.get("XLA_FLAGS", "")):  # the same flags, repeated or reordered, are no change
    changes["XLA_FLAGS"] = xla
  changes = {k: v for k, v in changes.items() if os.environ.get(k) != v}
  if changes and _backend_started():
    raise UserError(
      f"JAX has already started, so {', '.join(sorted(changes))} would not take effect; "
      "set XLA flags and environment before JAX starts (python -m MaxText.train does)"
    )
  for name, value in env.items():
    if name in os.environ and os.environ[name] != value:
      notes.append(f"{name}={value} replaces {os.environ[name]!r} from the environment")
  os.environ.update(changes)
  return {"xla_flags": xla, "env": env, "notes": notes}


def in_force(environ=None) -> dict[str, str]:
  """The XLA/CUDA/NCCL/JAX variables of this process (what the run directory records)."""
  environ = os.environ if environ is None else environ
  return {k: environ[k] for k in sorted(environ) if k.startswith(RECORDED_PREFIXES)}


def describe_presets() -> list[str]:
  lines = [f"xla_flag_presets {n}: {why}: {' '.join(f)}" for n, (why, f) in XLA_PRESETS.items()]
  lines += [
    f"env_presets {n}: {why}: {' '.join(f'{k}={v}' for k, v in e.items())}" for n, (why, e) in ENV_PRESETS.items()
  ]
  return lines
