"""Quantised expert grouped GEMMs, chosen by `quantization` (MoE section) on top of `moe_gmm_backend`.

  ""             no quantisation: the backend's own gmm
  mxfp8          MXFP8 (OCP MX: e4m3, e8m0 scale per 32), by `mxfp8_impl`: block-scaled products
                 (mxfp8_block_scaled.py; the tensor cores' block-scaled MMA on Blackwell) or emulated
                 on the bf16 backend (mxfp8.py)
  fp8_blockwise  DeepSeek-V3 FP8 (e4m3, fp32 scales per 1x128 / 128x128), fp32-accumulating kernels
                 with in-kernel scales: `mosaic` (Hopper) or `xla` (jnp reference) (fp8_blockwise.py)

Formats are in formats.py, per-group row alignment for the weight gradient in groups.py. Every
choice returns the same interface as gmm/: gmm(x [rows, K], w [G, K, N], group_sizes) -> [rows, N].
"""

import functools

import jax
import jax.numpy as jnp

from MaxText.moe import gmm as gmm_registry
from MaxText.moe.gmm import vjp

CHOICES = ("", "mxfp8", "fp8_blockwise")
FP8_BLOCKWISE_BACKENDS = ("mosaic", "xla")
MXFP8_IMPLS = ("block_scaled", "emulated")
BLOCK_SCALED_MMA_MAJOR = 10  # sm_100 (Blackwell): tcgen05 MMA with block scales


def check(name: str, backend: str) -> str | None:
  """Why `name` cannot run on `backend` (one line), or None."""
  if name not in CHOICES:
    return f"unknown quantization '{name}'; choose one of: {', '.join(repr(c) for c in CHOICES)}"
  if name and backend == "padded":
    return f"quantization={name} needs contiguous groups (moe_dispatch=sort); moe_gmm_backend=padded uses the capacity layout"
  if name == "fp8_blockwise" and backend not in (*FP8_BLOCKWISE_BACKENDS, "auto"):
    return f"quantization=fp8_blockwise runs its own kernels: moe_gmm_backend=mosaic (Hopper) or xla (reference); got {backend}"
  return None


def _kernels(backend: str, mosaic_kernels: str | None):
  """(fwd, dgrad, wgrad) of a bf16 backend; for backends without separate kernels, from its VJP."""
  if backend == "mosaic":
    from MaxText.moe.gmm import mosaic

    return mosaic.kernel_functions(mosaic_kernels or mosaic.DEFAULT_KERNELS)
  if backend == "xla":
    return vjp.xla_fwd, vjp.xla_dgrad, vjp.xla_wgrad
  return _kernels_from_vjp(gmm_registry.get_gmm(backend))


def _kernels_from_vjp(f):
  def dgrad(dy, w, sizes):  # f is linear in x: its VJP at any x (zeros) is the dgrad
    return jax.vjp(lambda x: f(x, w, sizes), jnp.zeros((dy.shape[0], w.shape[1]), dy.dtype))[1](dy)[0]

  def wgrad(x, dy, sizes):
    return jax.vjp(lambda w: f(x, w, sizes), jnp.zeros((sizes.shape[0], x.shape[1], dy.shape[1]), x.dtype))[1](dy)[0]

  return f, dgrad, wgrad


def has_block_scaled_mma(device: jax.Device) -> bool:
  capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
  return capability is not None and int(str(capability).split(".")[0]) >= BLOCK_SCALED_MMA_MAJOR


def resolve_mxfp8(impl: str, device: jax.Device) -> str:
  """`mxfp8_impl` with auto decided for `device`: block-scaled products where the tensor cores apply the
  scales, the emulation elsewhere (see benchmarks/results for the two on an H200)."""
  if impl != "auto":
    return impl
  return "block_scaled" if has_block_scaled_mma(device) else "emulated"


@functools.cache
def quantized_gmm(
  name: str, backend: str, mosaic_kernels: str | None = None, mxfp8_impl: str = "emulated"
) -> gmm_registry.Gmm:
  """The grouped GEMM for `quantization=name` on the resolved `moe_gmm_backend` (not auto), with mosaic's
  kernel set `mosaic_kernels` (moe_mosaic_kernels; None: the default) and, for mxfp8, the resolved
  `mxfp8_impl` (resolve_mxfp8)."""
  if (why := check(name, backend)) or backend == "auto":
    raise ValueError(why or "resolve moe_gmm_backend=auto first")
  if not name:
    return gmm_registry.get_gmm(backend, mosaic_kernels)
  if name == "mxfp8":
    if mxfp8_impl not in MXFP8_IMPLS:
      raise ValueError(f"mxfp8_impl={mxfp8_impl}: choose one of {', '.join(MXFP8_IMPLS)} (resolve auto first)")
    if mxfp8_impl == "block_scaled":
      from MaxText.quant import mxfp8_block_scaled

      return mxfp8_block_scaled.make_gmm()
    from MaxText.quant import mxfp8

    return mxfp8.make_gmm(*_kernels(backend, mosaic_kernels))
  from MaxText.quant import fp8_blockwise

  if backend == "mosaic" and not gmm_registry.available("mosaic"):
    raise RuntimeError(
      "quantization=fp8_blockwise with moe_gmm_backend=mosaic needs jax's Pallas Mosaic GPU; upgrade jax"
    )
  return fp8_blockwise.make_gmm(fp8_kernels(backend, mosaic_kernels))


def labels() -> list[str]:
  """The quantised grouped GEMMs that benchmarks and GPU checks name (labelled_gmm): each quantization,
  fp8_blockwise:VARIANT for one of fp8_blockwise.MOSAIC_VARIANTS, mxfp8:IMPL for an mxfp8_impl."""
  from MaxText.quant import fp8_blockwise

  return [
    "fp8_blockwise",
    *(f"fp8_blockwise:{v}" for v in fp8_blockwise.MOSAIC_VARIANTS),
    "mxfp8",
    *(f"mxfp8:{i}" for i in MXFP8_IMPLS),
  ]


def labelled_gmm(label: str, device: jax.Device) -> gmm_registry.Gmm:
  """The grouped GEMM `label` (one of labels()) names, on moe_gmm_backend=mosaic: a bare quantization is what
  it runs by default on `device` (mxfp8_impl=auto decided for it)."""
  if label not in labels():
    raise ValueError(f"{label}: choose one of {', '.join(labels())}")
  name, _, choice = label.partition(":")
  if name == "mxfp8":
    return quantized_gmm(name, "mosaic", None, resolve_mxfp8(choice or "auto", device))
  if choice:
    from MaxText.quant import fp8_blockwise

    return fp8_blockwise.make_gmm(fp8_blockwise.MosaicKernels(**fp8_blockwise.MOSAIC_VARIANTS[choice]))
  return quantized_gmm(name, "mosaic")


def fp8_kernels(backend: str, mosaic_kernels: str | None = None):
  """fp8_blockwise's kernels on `backend`: on mosaic, warp-specialized ones when the bf16 kernel set is."""
  from MaxText.quant import fp8_blockwise

  if backend == "mosaic":
    from MaxText.moe.gmm import mosaic

    if (mosaic_kernels or mosaic.DEFAULT_KERNELS) in mosaic.WARP_SPECIALIZED:
      return fp8_blockwise.WS_KERNELS
  return fp8_blockwise.KERNELS[backend]


def describe(name: str, backend: str, device: jax.Device, mxfp8_impl: str = "emulated") -> str:
  """One log line: what runs for the expert GEMMs, and whether it is emulated."""
  if name == "mxfp8" and mxfp8_impl == "block_scaled":
    where = (
      "the tensor cores' block-scaled MMA"
      if has_block_scaled_mma(device)
      else f"dequantised by XLA first: {device.device_kind} has no block-scaled MMA (mxfp8_impl=auto picks the emulation here)"
    )
    return (
      f"quantization=mxfp8: e4m3 operands with e8m0 scales per 32 into jax.lax.scaled_dot (XLA's Triton GEMM), "
      f"one product per group window, {where}"
    )
  if name == "mxfp8":
    return (
      f"quantization=mxfp8 is emulated on {device.device_kind}: operands quantised to MXFP8 and dequantised "
      f"into the {backend} grouped GEMM ({device.device_kind} has no block-scaled MMA; mxfp8_impl=block_scaled "
      "runs the products on it where it does, sm_100+)"
    )
  if name == "fp8_blockwise":
    if backend == "mosaic":
      return (
        "quantization=fp8_blockwise: e4m3 Pallas Mosaic GPU grouped GEMMs (sm_90 wgmma), "
        "block scales applied in the kernel, fp32 accumulation"
      )
    return (
      "quantization=fp8_blockwise: jnp reference kernels (same blockwise math; fp32 products, no fp8 speed-up); "
      "use moe_gmm_backend=mosaic on Hopper"
    )
  return "quantization off"
