"""What is installed and usable: `python -m MaxText.doctor [--json]` (also `make doctor`).

One line per item: status (ok / missing / unusable), name, detail. Exit code 0
when the required pieces (Python, jax/jaxlib, numpy, optax, PyYAML, at least
one device) are usable, 1 otherwise. Optional packages are only located
(find_spec + installed metadata), never imported: importing torch, TE or
tensorflow_datasets takes seconds and can fail for reasons unrelated to what
the doctor reports.
"""

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys

from MaxText.errors import UserError, exit_on_user_error, first_line

USAGE = "usage: python -m MaxText.doctor [--json]"

OK, MISSING, UNUSABLE = "ok", "missing", "unusable"

MIN_PYTHON = (3, 12)
# Mirrors requirements.txt (tests/test_doctor.py checks that they agree).
MIN_VERSIONS = {
  "jax": "0.11.2",
  "jaxlib": "0.11.2",
  "numpy": "2.0",
  "optax": "0.2.6",
  "PyYAML": "6.0",
  "packaging": "24.0",
  "tensorboardX": "2.6",
  "orbax-checkpoint": "0.12.8",
  "grain": "0.2.18",
  "array-record": "0.8.6",
  "protobuf": "5.28.3",
  "tensorflow-datasets": "4.9.10",
  "pyarrow": "26.0",
  "datasets": "5.2.0",
  "sentencepiece": "0.2.3",
  "tiktoken": "0.14.0",
  "tokenizers": "0.23.3",
  "tensorstore": "0.1.86",
  "etils": "1.15",
}

# (module, distribution, required, what it is for); tensorboardX is only needed with enable_tensorboard.
CORE_PACKAGES = [
  ("jax", "jax", True, "arrays, jit, sharding"),
  ("jaxlib", "jaxlib", True, "XLA runtime for jax"),
  ("numpy", "numpy", True, "host arrays"),
  ("optax", "optax", True, "optimizer"),
  ("yaml", "PyYAML", True, "recipe and config files"),
  ("packaging", "packaging", True, "reading installed packages' requirements"),
  ("tensorboardX", "tensorboardX", False, "enable_tensorboard=true"),
]

# (name, module, distributions to read the version from, what it enables, how to install).
OPTIONAL_PACKAGES = [
  ("tokamax", "tokamax", ("tokamax",), "tokamax Pallas kernels: moe_gmm_backend=tokamax", "pip install tokamax"),
  ("torch", "torch", ("torch",), "PyTorch: parity tests and benchmarks", "pip install torch"),
  (
    "orbax-checkpoint",
    "orbax.checkpoint",
    ("orbax-checkpoint",),
    "checkpoint save and restore",
    "pip install orbax-checkpoint",
  ),
  ("grain", "grain", ("grain",), "grain data loading pipelines", "pip install grain"),
  (
    "protobuf",
    "google.protobuf",
    ("protobuf",),
    "tf.train.Example records (TFDS and pre-tokenized ArrayRecord data)",
    "pip install protobuf",
  ),
  (
    "tensorflow_datasets",
    "tensorflow_datasets",
    ("tensorflow-datasets",),
    "TFDS datasets",
    "pip install tensorflow-datasets",
  ),
  (
    "transformers",
    "transformers",
    ("transformers",),
    "Hugging Face tokenizers and checkpoint conversion",
    "pip install transformers",
  ),
  ("safetensors", "safetensors", ("safetensors",), "reading .safetensors checkpoints", "pip install safetensors"),
]

# CUDA major -> (kernel package, PJRT plugin), each as (module, distribution). jax[cudaNN] installs both.
CUDA_PLUGINS = {
  13: (("jax_cuda13_plugin", "jax-cuda13-plugin"), ("jax_plugins.xla_cuda13", "jax-cuda13-pjrt")),
  12: (("jax_cuda12_plugin", "jax-cuda12-plugin"), ("jax_plugins.xla_cuda12", "jax-cuda12-pjrt")),
}

MOSAIC_GMM_MODULE = "jax.experimental.pallas.mosaic_gpu"
HOPPER = "9.0"

ENV_VARS = [
  "XLA_FLAGS",
  "XLA_PYTHON_CLIENT_MEM_FRACTION",
  "CUDA_DEVICE_MAX_CONNECTIONS",
  "CUDA_VISIBLE_DEVICES",
  "JAX_PLATFORMS",
]


@dataclasses.dataclass(frozen=True)
class Check:
  name: str
  status: str  # OK, MISSING or UNUSABLE
  detail: str
  required: bool = False


def version_tuple(version: str) -> tuple[int, ...]:
  """The dotted numeric prefix of a PEP 440 version ('0.12.0.1rc1' -> (0, 12, 0, 1)), as jaxlib compares plugins."""
  m = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
  return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def dist_version(*dists: str) -> str | None:
  for dist in dists:
    try:
      return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None


def locate(module: str):
  """(spec or None, error or None) without importing the module itself.

  A dotted name imports its parent packages: a missing parent means the module
  is missing, a parent that fails to import means it is there but unusable.
  """
  try:
    return importlib.util.find_spec(module), None
  except ModuleNotFoundError:
    return None, None
  except Exception as e:  # noqa: BLE001 - any failure of a parent's import makes the module unusable
    return None, first_line(e)


def check_python() -> Check:
  v = sys.version_info
  need = ".".join(map(str, MIN_PYTHON))
  status = OK if v[:2] >= MIN_PYTHON else UNUSABLE
  return Check("python", status, f"{v.major}.{v.minor}.{v.micro} (needs >= {need}) at {sys.executable}", required=True)


def check_core(module: str, dist: str, required: bool, purpose: str) -> Check:
  """Imports the package (the training run will), so a broken install shows up as unusable."""
  need = MIN_VERSIONS.get(dist)
  if required:
    try:
      mod = importlib.import_module(module)
    except ImportError as e:
      spec, _ = locate(module)
      return Check(dist, UNUSABLE if spec else MISSING, f"{first_line(e)} ({purpose})", required)
    except Exception as e:  # noqa: BLE001 - a package that raises on import is there but unusable
      return Check(dist, UNUSABLE, f"import failed: {first_line(e)} ({purpose})", required)
    version = getattr(mod, "__version__", None) or dist_version(dist) or "unknown"
  else:
    spec, err = locate(module)
    version = dist_version(dist)
    if spec is None:
      return Check(
        dist, UNUSABLE if err else MISSING, err or f"not installed ({purpose}); pip install {dist}", required
      )
    version = version or "unknown"
  if need and version_tuple(version) < version_tuple(need):
    return Check(dist, UNUSABLE, f"{version} (needs >= {need})", required)
  return Check(dist, OK, f"{version}" + (f" (needs >= {need})" if need else "") + f"; {purpose}", required)


def check_backend() -> tuple[list[Check], list]:
  """The default platform and the devices jax sees; returns the checks and the device list."""
  try:
    import jax

    devices = jax.devices()
    platform = jax.default_backend()
    processes = jax.process_count()
  except ImportError as e:
    return [Check("jax backend", MISSING, f"jax not importable: {first_line(e)}", required=True)], []
  except Exception as e:  # noqa: BLE001 - backend initialization failures (driver, plugin) are reported, not raised
    return [Check("jax backend", UNUSABLE, f"no devices: {first_line(e)}", required=True)], []
  if not devices:
    return [Check("jax backend", UNUSABLE, f"{platform}: no devices", required=True)], []
  checks = [
    Check("jax backend", OK, f"platform {platform}: {len(devices)} device(s), {processes} process(es)", required=True)
  ]
  kinds: dict[str, list] = {}
  for d in devices:
    kinds.setdefault(d.device_kind, []).append(d)
  gpu_capabilities = set()
  for kind, ds in kinds.items():
    detail = f"{len(ds)} x {kind} ({ds[0].platform})"
    if is_gpu(ds[0]):
      cc = getattr(ds[0], "compute_capability", None)
      detail += f", compute capability {cc}" if cc else ", compute capability not reported"
      gpu_capabilities.add(cc)
    checks.append(Check("device", OK, detail))
  if gpu_capabilities:
    checks.append(check_hopper(gpu_capabilities))
  return checks, devices


def is_gpu(device) -> bool:
  return device.platform in ("gpu", "cuda")


def all_hopper(devices: list) -> bool:
  """There are GPUs, and every one is sm_90 (what the Mosaic GPU kernels need)."""
  return any(is_gpu(d) for d in devices) and all(
    getattr(d, "compute_capability", None) == HOPPER for d in devices if is_gpu(d)
  )


def check_hopper(capabilities: set) -> Check:
  name = "hopper (sm_90)"
  purpose = "Mosaic GPU grouped-GEMM kernels (moe_gmm_backend=mosaic)"
  if capabilities == {HOPPER}:
    return Check(name, OK, f"all GPUs are sm_90: {purpose} can run")
  found = ", ".join(sorted(str(c) if c else "not reported" for c in capabilities))
  return Check(name, UNUSABLE, f"compute capability {found}, not only 9.0: {purpose} need Hopper")


def check_cuda_plugins(devices: list) -> list[Check]:
  jaxlib_version = dist_version("jaxlib")
  sees_gpu = any(is_gpu(d) for d in devices)
  checks = []
  for major, ((kernel_mod, kernel_dist), (pjrt_mod, pjrt_dist)) in CUDA_PLUGINS.items():
    kernel_spec, kernel_err = locate(kernel_mod)
    pjrt_spec, pjrt_err = locate(pjrt_mod)
    if kernel_spec is None and pjrt_spec is None and not (kernel_err or pjrt_err):
      continue
    parts = [
      f"{dist} {dist_version(dist) or 'unknown'}"
      for dist, spec in ((kernel_dist, kernel_spec), (pjrt_dist, pjrt_spec))
      if spec
    ]
    detail = ", ".join(parts)
    install = (
      f"pip install 'jax[cuda{major}]=={jaxlib_version}'" if jaxlib_version else f"pip install 'jax[cuda{major}]'"
    )
    kernel_version = dist_version(kernel_dist)
    name = f"cuda{major} plugin"
    if kernel_err or pjrt_err:
      checks.append(Check(name, UNUSABLE, f"{detail}; {kernel_err or pjrt_err}"))
    elif kernel_spec is None or pjrt_spec is None:
      missing = kernel_dist if kernel_spec is None else pjrt_dist
      checks.append(Check(name, UNUSABLE, f"{detail}; {missing} is not installed; {install}"))
    elif jaxlib_version and kernel_version and version_tuple(kernel_version) != version_tuple(jaxlib_version):
      # jaxlib refuses a kernel plugin whose version differs from its own.
      checks.append(Check(name, UNUSABLE, f"{detail}; jaxlib is {jaxlib_version}, so jax will not use it; {install}"))
    elif devices and not sees_gpu:
      checks.append(
        Check(
          name, UNUSABLE, f"{detail}; installed, but jax found no GPU (driver? CUDA_VISIBLE_DEVICES? JAX_PLATFORMS?)"
        )
      )
    else:
      checks.append(Check(name, OK, detail))
  if not checks:
    checks.append(
      Check("cuda plugin", MISSING, "no jax-cuda13/jax-cuda12 plugin: jax runs on CPU only; pip install 'jax[cuda13]'")
    )
  return checks


def check_mosaic_kernels() -> Check:
  name = "pallas mosaic gpu"
  purpose = "moe_gmm_backend=mosaic (needs sm_90)"
  spec, err = locate(MOSAIC_GMM_MODULE)
  if err:
    return Check(name, UNUSABLE, f"{MOSAIC_GMM_MODULE}: {err}")
  if spec is None:
    return Check(name, MISSING, f"{MOSAIC_GMM_MODULE} not in this jax: no {purpose}")
  return Check(name, OK, f"{MOSAIC_GMM_MODULE} found: {purpose}")


def check_optional(name: str, module: str, dists: tuple[str, ...], purpose: str, install: str) -> Check:
  spec, err = locate(module)
  if err:
    return Check(name, UNUSABLE, f"{err} ({purpose})")
  if spec is None:
    return Check(name, MISSING, f"not installed ({purpose}); {install}")
  version = dist_version(*dists) or "unknown version"
  try:
    from MaxText import installed
  except ImportError:  # packaging, a required package, is missing: its own line says so, and requirements go unread
    return Check(name, OK, f"{version}; {purpose}")
  if unmet := [r for d in dists for r in installed.unmet_requirements(d)]:
    names = " ".join(f"'{r.split(' (')[0]}'" for r in unmet)
    detail = f"{version}, installed without its requirements {', '.join(unmet)}; pip install {names}"
    return Check(name, UNUSABLE, detail)
  return Check(name, OK, f"{version}; {purpose}")


def check_env() -> list[Check]:
  names = [v for v in ENV_VARS if v in os.environ] + sorted(v for v in os.environ if v.startswith("NCCL_"))
  if not names:
    return [Check("environment", OK, f"none of {', '.join(ENV_VARS)}, NCCL_* set")]
  return [Check(v, OK, os.environ[v]) for v in names]


def check_xla_flags() -> list[Check]:
  """XLA_FLAGS and every xla_flag_presets entry against the flag names of the installed jaxlib/CUDA plugin.

  Runs before the backend starts: XLA aborts the process on an unknown flag in XLA_FLAGS.
  """
  from MaxText import runtime_env, xla_flags

  try:
    libs = xla_flags.libraries()
    env_flags = [(n, t, "XLA_FLAGS") for n, t in runtime_env.parse_flags(os.environ.get("XLA_FLAGS", ""), "XLA_FLAGS")]
    runtime_env.validate(env_flags, libs)
  except UserError as e:
    return [Check("XLA_FLAGS", UNUSABLE, f"{e} (jax would abort at start)", required=True)]
  against = " + ".join(lib.label for lib in libs)
  checks = [Check("XLA_FLAGS", OK, f"{len(env_flags)} flag(s), all known to {against}", required=True)]
  bad = []
  for name, (_, flags) in runtime_env.XLA_PRESETS.items():
    try:
      runtime_env.validate([(n, t, f"preset {name}") for n, t in runtime_env.parse_flags(" ".join(flags), name)], libs)
    except UserError as e:
      bad.append(str(e))
  if bad:
    checks.append(Check("xla flag presets", UNUSABLE, "; ".join(bad)))
  else:
    checks.append(Check("xla flag presets", OK, f"{', '.join(runtime_env.XLA_PRESETS)}: every flag known to {against}"))
  return checks


NCCL_DISTS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")


def nccl_libraries() -> list[str]:
  """Candidate libnccl shared libraries: the pip wheel's (what the CUDA plugin loads), then the system's."""
  import ctypes.util

  found = []
  spec, _ = locate("nvidia.nccl")
  for loc in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(loc, "lib", "libnccl.so.2")
    if os.path.isfile(path):
      found.append(path)
  system = ctypes.util.find_library("nccl")
  if system:
    found.append(system)
  return found


def nccl_version_of(library: str) -> str | None:
  """ncclGetVersion of a libnccl (no GPU needed), as 'major.minor.patch'; None if it cannot be loaded."""
  import ctypes

  try:
    code = ctypes.c_int()
    if ctypes.CDLL(library).ncclGetVersion(ctypes.byref(code)) != 0:
      return None
  except (OSError, AttributeError):
    return None
  return nccl_version_string(code.value)


def nccl_version_string(code: int) -> str:
  """NCCL_VERSION_CODE -> 'major.minor.patch' (>= 2.9: major*10000 + minor*100 + patch; before: major*1000 + ...)."""
  major, rest = (code // 10000, code % 10000) if code >= 20900 else (code // 1000, code % 1000)
  return f"{major}.{rest // 100}.{rest % 100}"


def check_nccl() -> Check:
  purpose = "collectives between GPUs (FSDP, expert parallelism, multi-node)"
  for library in nccl_libraries():
    version = nccl_version_of(library)
    if version:
      return Check("nccl", OK, f"{version} ({library}); {purpose}")
  version = dist_version(*NCCL_DISTS) or os.environ.get("NCCL_VERSION")
  if version:
    return Check(
      "nccl",
      OK,
      f"{version} (from {'the wheel metadata' if dist_version(*NCCL_DISTS) else 'NCCL_VERSION'}; "
      f"library not loadable here); {purpose}",
    )
  return Check(
    "nccl", MISSING, f"no libnccl found: {purpose} need it; pip install 'jax[cuda13]' brings nvidia-nccl-cu13"
  )


def check_host_memory(devices: list) -> Check:
  purpose = "host offload (optimizer_/parameter_memory_host_offload, remat offload)"
  if not devices:
    return Check("pinned host memory", UNUSABLE, f"no devices; {purpose}")
  try:
    kinds = sorted(m.kind for m in devices[0].addressable_memories())
  except Exception as e:  # noqa: BLE001 - a backend without memory spaces reports it, not raises
    return Check("pinned host memory", UNUSABLE, f"memory kinds not reported: {first_line(e)}; {purpose}")
  if "pinned_host" in kinds:
    return Check("pinned host memory", OK, f"{devices[0].device_kind} memories: {', '.join(kinds)}; {purpose} can run")
  return Check(
    "pinned host memory",
    UNUSABLE,
    f"{devices[0].device_kind} memories: {', '.join(kinds)}, no pinned_host; no {purpose}",
  )


def check_moe_backends(devices: list) -> list[Check]:
  """Which moe_dispatch choices and expert GEMMs can run here (from their registries)."""
  from MaxText import gmm
  from MaxText.moe import dispatch, ep

  platform = "gpu" if any(is_gpu(d) for d in devices) else "cpu"
  hopper = all_hopper(devices)
  dispatch_ok, dispatch_not = [], []
  for name in (*dispatch.DISPATCHERS, *ep.BACKENDS):
    problem = ep.unavailable(name, platform) if ep.is_ep(name) else None
    (dispatch_not.append(f"{name} ({problem})") if problem else dispatch_ok.append(name))
  gmm_ok, gmm_not = [], []
  for name, entry in gmm.EXPERT_GEMMS.items():
    problem = gmm.unavailable(name)
    if problem is None and entry.hopper_only and not hopper:
      problem = "needs sm_90 GPUs"
    (gmm_not.append(f"{name} ({problem})") if problem else gmm_ok.append(name))

  def line(ok, bad):
    return f"usable: {', '.join(ok) or 'none'}" + (f"; not here: {'; '.join(bad)}" if bad else "")

  checks = [
    Check("moe_dispatch", OK if dispatch_ok else UNUSABLE, line(dispatch_ok, dispatch_not)),
    Check("expert GEMM", OK if gmm_ok else UNUSABLE, line(gmm_ok, gmm_not)),
  ]
  if "mosaic" in gmm_ok:  # which tuned tiles the Mosaic kernels take on these GPUs
    from MaxText.kernels import mosaic_tiles

    kinds = sorted({d.device_kind for d in devices if is_gpu(d)})
    checks.append(Check("mosaic tiles", OK, "; ".join(mosaic_tiles.table_note(k) for k in kinds)))
  return checks


def check_quantization(devices: list) -> Check:
  """What `quantization` runs as on these devices."""
  from MaxText import gmm
  from MaxText.kernels import gpu

  hopper_kernels = gmm.unavailable("fp8_blockwise:mosaic") is None and all_hopper(devices)
  native = bool(devices) and all(gpu.has_block_scaled_mma(d) for d in devices)
  mx = (
    "mxfp8_impl=auto -> block_scaled (tensor-core block-scaled MMA)"
    if native
    else "mxfp8_impl=auto -> emulated (no block-scaled MMA here: dequantised into the bf16 grouped GEMM)"
  )
  fp8 = (
    "Hopper kernels (moe_gmm_backend=mosaic)"
    if hopper_kernels
    else "jnp reference only (moe_gmm_backend=xla, no fp8 speed-up; the fp8 kernels need sm_90)"
  )
  return Check("quantization", OK, f"mxfp8: {mx}; fp8_blockwise: {fp8}")


def collect() -> list[Check]:
  checks = [check_python()]
  checks += [check_core(*p) for p in CORE_PACKAGES]
  flag_checks = check_xla_flags()
  checks += flag_checks
  if flag_checks[0].status != OK:  # starting the backend would abort the process
    return checks + [
      Check("jax backend", UNUSABLE, "not started: XLA_FLAGS holds a flag this jaxlib does not know", required=True)
    ]
  backend, devices = check_backend()
  checks += backend
  checks += check_cuda_plugins(devices)
  checks.append(check_mosaic_kernels())
  checks.append(check_nccl())
  checks.append(check_host_memory(devices))
  checks += check_moe_backends(devices)
  checks.append(check_quantization(devices))
  checks += [check_optional(*p) for p in OPTIONAL_PACKAGES]
  checks += check_env()
  return checks


def usable(checks: list[Check]) -> bool:
  return all(c.status == OK for c in checks if c.required)


def format_text(checks: list[Check]) -> str:
  width = max(len(c.name) for c in checks)
  lines = [f"{c.status:<9} {c.name:<{width}}  {c.detail}" for c in checks]
  broken = [f"{c.name} ({c.status})" for c in checks if c.required and c.status != OK]
  lines.append("required pieces: all usable" if not broken else f"required pieces not usable: {', '.join(broken)}")
  return "\n".join(lines)


@exit_on_user_error
def main(argv: list[str]) -> int:
  as_json = False
  for arg in argv:
    if arg in ("-h", "--help"):
      print(USAGE)
      return 0
    if arg != "--json":
      raise UserError(f"unknown argument '{arg}'; {USAGE}")
    as_json = True
  checks = collect()
  ok = usable(checks)
  if as_json:
    print(json.dumps({"ok": ok, "checks": [dataclasses.asdict(c) for c in checks]}, indent=2))
  else:
    print(format_text(checks))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
