"""Grouped GEMM backends behind one interface, chosen by `moe_gmm_backend`.

  gmm(x [rows, K], w [groups, K, N], group_sizes [groups]) -> [rows, N], differentiable in x and w

Rows are grouped contiguously: row r of group g is multiplied by w[g]. Rows past
sum(group_sizes) are padding: what a backend writes there is unspecified, and
callers never read them (the dispatchers' combine only gathers real rows).

  xla      jax.lax.ragged_dot; any device; the baseline
  padded   batched einsum over equal-capacity groups (moe_dispatch=capacity); the fixed-capacity baseline
  mosaic   Hopper Pallas Mosaic GPU kernels, forward/dgrad/wgrad under one custom VJP (gmm/mosaic.py)
  tokamax  tokamax.ragged_dot, when tokamax is installed
  te       Transformer Engine grouped_dense, when transformer_engine is installed
  auto     resolved once at start by `resolve` (the log says what it chose and why)
"""

import importlib
import importlib.util
from collections.abc import Callable

import jax

Gmm = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# backend -> (module, package that must be importable for it, or None)
BACKENDS = {
  "xla": ("MaxText.moe.gmm.xla", None),
  "padded": ("MaxText.moe.gmm.padded", None),
  "mosaic": ("MaxText.moe.gmm.mosaic", "jax.experimental.pallas.ops.gpu.ragged_dot_mgpu"),
  "tokamax": ("MaxText.moe.gmm.tokamax", "tokamax"),
  "te": ("MaxText.moe.gmm.te", "transformer_engine"),
}
CHOICES = (*BACKENDS, "auto")
INSTALL_HINT = {"tokamax": "pip install tokamax", "te": "pip install 'transformer_engine[jax]'"}

# Why `auto` prefers mosaic on sm_90: measured on one H200 (benchmarks/results/, see README),
# fwd+bwd at DeepSeek-V3 expert shapes, mosaic beats xla ragged_dot by >10x at 32 groups.
AUTO_EVIDENCE = "benchmarks/results/2026-12-02-h200-grouped-gemm"


def available(name: str) -> bool:
  requirement = BACKENDS[name][1]
  try:
    return requirement is None or importlib.util.find_spec(requirement) is not None
  except ModuleNotFoundError:
    return False


def get_gmm(name: str, mosaic_kernels: str | None = None) -> Gmm:
  """The backend's gmm; `mosaic_kernels` names mosaic's kernel set (moe_mosaic_kernels; None: its default)."""
  if name not in BACKENDS:
    raise ValueError(f"unknown moe_gmm_backend '{name}'; choose one of: {', '.join(CHOICES)} (resolve 'auto' first)")
  if not available(name):
    raise RuntimeError(
      f"moe_gmm_backend={name} needs {BACKENDS[name][1]}, which is not installed; {INSTALL_HINT.get(name, 'upgrade jax')}"
    )
  module = importlib.import_module(BACKENDS[name][0])
  return module.make_gmm(mosaic_kernels) if name == "mosaic" and mosaic_kernels else module.gmm


def resolve(name: str, device: jax.Device, dtype: str) -> tuple[str, str]:
  """The backend to run for `name` on `device`, and why. A GPU that cannot run the named backend's kernels
  (mosaic's wgmma needs sm_90 exactly) is a ValueError with what to choose instead."""
  capability = getattr(device, "compute_capability", None)
  if name == "mosaic" and device.platform == "gpu" and capability not in (None, "9.0"):
    raise ValueError(
      f"moe_gmm_backend=mosaic runs Hopper (sm_90) wgmma kernels; {device.device_kind} is sm_{str(capability).replace('.', '')}: "
      "choose moe_gmm_backend=auto or xla (and quantization=mxfp8 rather than fp8_blockwise)"
    )
  if name != "auto":
    return name, "chosen in the config"
  if device.platform == "gpu" and capability == "9.0" and available("mosaic") and dtype in ("bfloat16", "float16"):
    return (
      "mosaic",
      f"{device.device_kind} is sm_90 and dtype={dtype}: Mosaic GPU kernels measured fastest ({AUTO_EVIDENCE})",
    )
  why = (
    "not an sm_90 GPU"
    if capability != "9.0"
    else f"dtype={dtype} is not bf16/fp16"
    if available("mosaic")
    else "Mosaic GPU kernels not in this jax"
  )
  return "xla", f"{device.device_kind}: {why}; jax.lax.ragged_dot runs everywhere"
