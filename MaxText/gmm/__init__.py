"""The expert grouped GEMMs: one registry of every choice, resolved once from the config into one object.

Each entry names a whole choice, `moe_gmm_backend` and `quantization` together:

  xla                   jax.lax.ragged_dot; any device; the baseline
  padded                one batched einsum over equal-capacity groups (moe_dispatch=capacity)
  mosaic                Hopper (sm_90) Pallas Mosaic GPU kernels under one custom VJP (kernels/mosaic_gmm.py)
  tokamax               tokamax.ragged_dot, when tokamax is installed
  mxfp8:BACKEND         MXFP8 operands, dequantised into BACKEND's bf16 kernels (mxfp8_impl=emulated)
  mxfp8:block_scaled    MXFP8 products on the e4m3 values and e8m0 scales (jax.lax.scaled_dot; Blackwell's MMA)
  fp8_blockwise:mosaic  DeepSeek-V3's fp8 (1x128 / 128x128 scales) in Hopper kernels (kernels/mosaic_fp8_gmm.py)
  fp8_blockwise:xla     the same blockwise math in jnp: CPU, and the reference

`resolve` picks the entry for a config and a device (`auto` decided there, with the reason), `build` makes
its ExpertGemm (base.py). Adding a backend is one module with `build(entry, options)` and one `register`
call: the config's choices, the doctor, the benchmarks and the GPU checks read them from here.
"""

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import NamedTuple

from MaxText.errors import first_line
from MaxText.gmm.base import ExpertGemm
from MaxText.kernels import gpu, mosaic_tiles

MOSAIC_MODULE = "jax.experimental.pallas.mosaic_gpu"
# Why `auto` prefers mosaic on sm_90: measured on one H200, fwd+bwd at DeepSeek-V3 expert shapes, mosaic
# beats xla ragged_dot by >10x at 32 groups.
AUTO_EVIDENCE = "benchmarks/results/2026-12-02-h200-grouped-gemm"


@dataclass(frozen=True)
class Entry:
  name: str
  quantization: str  # the `quantization` it implements ("" = none)
  backend: str  # the `moe_gmm_backend` it runs on ("" = whichever: it brings its own products)
  module: str  # its module's build(entry, options) returns the ExpertGemm
  about: str  # one line, for the doctor and the start-up log
  requires: str | None = None  # a module that must be importable
  install: str = "upgrade jax"  # how to get `requires`
  dist: str | None = None  # the distribution `install` installs, when it is not jax itself (its requirements too)
  hopper_only: bool = False  # its kernels use sm_90's wgmma: no other GPU, and no CPU except in tests' interpreter


@dataclass(frozen=True)
class Options:
  """What the config decides beyond the entry (fp8_blockwise's fusions), and the tests' interpreter."""

  fuse_activation: bool = True  # quantize_with_activation
  quantize_before_permute: bool = True
  interpret: object = False  # Pallas' GPU interpreter (CPU tests): False, True or plgpu.InterpretGPUParams


EXPERT_GEMMS: dict[str, Entry] = {}


def register(entry: Entry) -> Entry:
  if entry.name in EXPERT_GEMMS:
    raise ValueError(f"expert GEMM '{entry.name}' is registered twice")
  EXPERT_GEMMS[entry.name] = entry
  if "build" in globals():  # an entry registered after start-up: forget objects built before it
    build.cache_clear()
  return entry


register(Entry("xla", "", "xla", "MaxText.gmm.xla", "jax.lax.ragged_dot; any device; the baseline"))
register(
  Entry(
    "padded", "", "padded", "MaxText.gmm.padded", "batched einsum over equal-capacity groups (moe_dispatch=capacity)"
  )
)
register(
  Entry(
    "mosaic",
    "",
    "mosaic",
    "MaxText.gmm.mosaic",
    "Hopper Pallas Mosaic GPU kernels, warp-specialized",
    MOSAIC_MODULE,
    hopper_only=True,
  )
)
register(
  Entry(
    "tokamax", "", "tokamax", "MaxText.gmm.tokamax", "tokamax.ragged_dot", "tokamax", "pip install tokamax", "tokamax"
  )
)
for _backend in ("xla", "mosaic", "tokamax"):
  _bf16 = EXPERT_GEMMS[_backend]
  register(
    Entry(
      f"mxfp8:{_backend}",
      "mxfp8",
      _backend,
      "MaxText.gmm.mxfp8",
      f"MXFP8 operands dequantised into the {_backend} bf16 GEMM (mxfp8_impl=emulated)",
      _bf16.requires,
      _bf16.install,
      _bf16.dist,
      _bf16.hopper_only,
    )
  )
register(
  Entry(
    "mxfp8:block_scaled",
    "mxfp8",
    "",
    "MaxText.gmm.mxfp8_block_scaled",
    "MXFP8 products on e4m3 values and e8m0 scales (jax.lax.scaled_dot; tensor-core block scales on sm_100+)",
  )
)
register(
  Entry(
    "fp8_blockwise:mosaic",
    "fp8_blockwise",
    "mosaic",
    "MaxText.gmm.fp8_blockwise",
    "e4m3 Pallas Mosaic GPU grouped GEMMs (sm_90 wgmma), block scales applied in the kernel, fp32 accumulation",
    MOSAIC_MODULE,
    hopper_only=True,
  )
)
register(
  Entry(
    "fp8_blockwise:xla",
    "fp8_blockwise",
    "xla",
    "MaxText.gmm.fp8_blockwise",
    "fp8_blockwise's math in jnp (fp32 products, no fp8 speed-up): CPU, and the reference",
  )
)


def backends() -> tuple[str, ...]:
  """The values of `moe_gmm_backend`, auto included."""
  return (*dict.fromkeys(e.backend for e in EXPERT_GEMMS.values() if e.backend), "auto")


def quantizations() -> tuple[str, ...]:
  """The values of `quantization` ("" = off)."""
  return tuple(dict.fromkeys(("", *(e.quantization for e in EXPERT_GEMMS.values()))))


MXFP8_IMPLS = ("auto", "block_scaled", "emulated")


def entry_name(quantization: str, backend: str, mxfp8_impl: str = "emulated") -> str:
  """The registry name of a resolved choice (backend and mxfp8_impl not auto)."""
  if quantization == "mxfp8" and mxfp8_impl == "block_scaled":
    return "mxfp8:block_scaled"
  return f"{quantization}:{backend}" if quantization else backend


def check(quantization: str, backend: str, mxfp8_impl: str = "auto") -> str | None:
  """Why the configured combination has no entry (one line), or None. `backend` may be auto."""
  if mxfp8_impl != "auto" and quantization != "mxfp8":
    return f"mxfp8_impl={mxfp8_impl} applies only to quantization=mxfp8; remove it or set mxfp8_impl=auto"
  if backend == "auto" or (quantization == "mxfp8" and mxfp8_impl == "block_scaled"):
    return None
  if entry_name(quantization, backend, mxfp8_impl) in EXPERT_GEMMS:
    return None
  runs_on = [e.backend for e in EXPERT_GEMMS.values() if e.quantization == quantization and e.backend]
  what = f"quantization={quantization}" if quantization else "quantization off"
  return f"{what} runs on moe_gmm_backend={' or '.join(runs_on)} (got {backend})"


def unavailable(name: str, *, imports: bool = False) -> str | None:
  """Why entry `name` cannot be built here (a package missing, or installed without what it needs), or None.

  Without `imports` nothing is imported (the doctor, the config's suggestions): a package's missing requirements
  are read from its metadata. With it the package is imported, the one test that cannot be wrong, where the run
  will import it anyway (the chosen backend, before anything is written; `build`)."""
  entry = EXPERT_GEMMS[name]
  if entry.requires is None:
    return None
  try:
    found = importlib.util.find_spec(entry.requires) is not None
  except ModuleNotFoundError:
    found = False
  if not found:
    return f"needs {entry.requires}, which is not installed; {entry.install}"
  if imports:
    try:
      importlib.import_module(entry.requires)
    except Exception as e:  # noqa: BLE001 - whatever stops the import stops the backend
      return f"needs {entry.requires}, which is installed but does not import ({first_line(e)}); {entry.install}"
    return None
  from MaxText import installed

  if entry.dist and (unmet := installed.unmet_requirements(entry.dist)):
    return f"needs {entry.requires}, installed without its requirements {', '.join(unmet)}; {entry.install}"
  return None


def not_runnable_on(name: str, device) -> str | None:
  """Why entry `name`'s kernels cannot run on `device` (a GPU of another architecture), or None."""
  entry = EXPERT_GEMMS[name]
  if entry.hopper_only and getattr(device, "platform", None) == "gpu" and not gpu.is_hopper(device):
    return f"{entry.name} runs Hopper (sm_90) wgmma kernels; {device.device_kind} is {gpu.sm_name(device)}"
  return None


def resolve_backend(backend: str, device, dtype: str) -> tuple[str, str]:
  """`moe_gmm_backend` decided for `device` (auto), and why."""
  if backend != "auto":
    return backend, "chosen in the config"
  if gpu.is_hopper(device) and unavailable("mosaic") is None and dtype in ("bfloat16", "float16"):
    return (
      "mosaic",
      f"{device.device_kind} is sm_90 and dtype={dtype}: Mosaic GPU kernels measured fastest ({AUTO_EVIDENCE})",
    )
  if not gpu.is_hopper(device):
    why = "not an sm_90 GPU"
  elif unavailable("mosaic"):
    why = "Mosaic GPU kernels not in this jax"
  else:
    why = f"dtype={dtype} is not bf16/fp16"
  return "xla", f"{getattr(device, 'device_kind', device)}: {why}; jax.lax.ragged_dot runs everywhere"


def resolve_mxfp8(impl: str, device) -> str:
  """`mxfp8_impl` decided for `device`: block-scaled products where the tensor cores apply the scales, the
  emulation elsewhere (2.2-4.1x faster on an H200: benchmarks/results/2026-12-04-h200-mxfp8-block-scaled)."""
  if impl != "auto":
    return impl
  return "block_scaled" if gpu.has_block_scaled_mma(device) else "emulated"


class Resolved(NamedTuple):
  name: str  # the registry entry
  backend: str  # moe_gmm_backend with auto decided
  mxfp8_impl: str  # with auto decided
  why: str  # why this backend (for the log)


def resolve(quantization: str, backend: str, mxfp8_impl: str, device, dtype: str) -> Resolved:
  """The registry entry a config runs on `device`; a ValueError (one line) when it cannot run there."""
  backend, why = resolve_backend(backend, device, dtype)
  impl = resolve_mxfp8(mxfp8_impl, device)
  name = entry_name(quantization, backend, impl)
  if name not in EXPERT_GEMMS:
    raise ValueError(check(quantization, backend, "auto") or f"no expert GEMM '{name}'")
  if problem := not_runnable_on(name, device):
    raise ValueError(
      f"{problem}: choose moe_gmm_backend=auto or xla (and quantization=mxfp8 rather than fp8_blockwise)"
    )
  return Resolved(name, backend, impl, why)


@functools.cache
def build(name: str, options: Options = Options()) -> ExpertGemm:
  """The ExpertGemm of registry entry `name` (one object per name and options)."""
  if name not in EXPERT_GEMMS:
    raise ValueError(f"unknown expert GEMM '{name}'; choose one of: {', '.join(EXPERT_GEMMS)}")
  if problem := unavailable(name, imports=True):
    raise RuntimeError(f"{name} {problem}")
  entry = EXPERT_GEMMS[name]
  return importlib.import_module(entry.module).build(entry, options)


def describe(name: str, options: Options = Options(), device=None) -> str:
  """One start-up log line: what runs for the expert GEMMs, and which fusions apply."""
  entry = EXPERT_GEMMS[name]
  if name == "mxfp8:block_scaled" and device is not None and not gpu.has_block_scaled_mma(device):
    kind = getattr(device, "device_kind", device)
    entry = Entry(
      **{**entry.__dict__, "about": entry.about + f"; dequantised by XLA first: {kind} has no block-scaled MMA"}
    )
  fused = {
    "swiglu_down": "silu(gate) * up made in the down GEMM's quantisation pass (quantize_with_activation)",
    "quantized_rows": "tokens quantised once before the permute, fp8 rows moved (quantize_before_permute)",
  }
  line = f"expert GEMM {name}: {entry.about}"
  if entry.backend == "mosaic" and entry.module != "MaxText.gmm.fp8_blockwise" and device is not None:
    line += "; " + mosaic_tiles.table_note(getattr(device, "device_kind", str(device)))
  if entry.module == "MaxText.gmm.fp8_blockwise":
    on = [fused["swiglu_down"]] * options.fuse_activation + [fused["quantized_rows"]] * options.quantize_before_permute
    return line + ("; fused: " + "; ".join(on) if on else "; no fusions")
  if entry.quantization and (options.fuse_activation or options.quantize_before_permute):
    return line + "; quantize_with_activation and quantize_before_permute apply to fp8_blockwise only: ignored"
  return line
