"""Block-scaled FP8 formats: quantise and dequantise along chosen axes, in jnp.

  mxfp8          OCP Microscaling (MX) v1.0: e4m3 elements, one e8m0 (power-of-two) scale per
                 32 consecutive elements. Scale X = 2^(floor(log2(amax)) - 8), 8 being the exponent
                 of e4m3's largest power of two (256); elements x / X rounded to nearest even and
                 clamped to +-448. An all-zero block gets the smallest scale, 2^-127. A block holding
                 Inf or NaN gets the NaN scale (0xFF), so all its elements decode to NaN (as the
                 reference implementation, microsoft/microxcaling, does).
  fp8_blockwise  DeepSeek-V3 (arXiv 2412.19437, section 3.3): e4m3 elements, an fp32 scale
                 amax / 448 (as amax * fp32(1/448), at least 2^-126) per 1x128 tile of activations and per
                 128x128 block of weights; elements x * (1 / scale), the reciprocal rounded once per block
                 (a multiply per element, as DeepSeek's reference does, so that fused GPU kernels and XLA
                 agree bit for bit), rounded to nearest even and clamped to +-448. An all-zero block gets
                 scale 1; a block holding Inf or NaN gets a NaN scale.

Scales are stored as the factor that dequantises (x ~ q * scale): e8m0 for mxfp8, fp32 for blockwise.
Shapes: q has x's shape; scales have x's shape with each blocked axis n replaced by ceil(n / block).
A last partial block is zero-padded for its amax (zeros never raise the amax), so any width works.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.kernels.fp8_scale import E4M3, E4M3_MAX, FP8_BLOCK, MIN_SCALE, blockwise_scale  # noqa: F401 (the format's)

E4M3_EMAX = 8  # floor(log2(448)): the exponent of e4m3's largest power of two
E8M0 = jnp.float8_e8m0fnu
E8M0_MIN_EXP = -127
MX_BLOCK = 32


class Quantized(NamedTuple):
  q: jax.Array  # e4m3, the input's shape
  scale: jax.Array  # e8m0 (mxfp8) or float32 (blockwise), one per block
  blocks: tuple[tuple[int, int], ...]  # (axis, block size) pairs; axes non-negative


def _norm(blocks: dict[int, int], ndim: int) -> tuple[tuple[int, int], ...]:
  return tuple(sorted((a % ndim, b) for a, b in blocks.items()))


def _split(x: jax.Array, blocks) -> tuple[jax.Array, tuple[int, ...]]:
  """x zero-padded to block multiples, each blocked axis split into (n/b, b); the within-block axes."""
  sizes = dict(blocks)
  x = jnp.pad(x, [(0, -n % sizes.get(a, 1)) for a, n in enumerate(x.shape)])
  shape, inner = [], []
  for a, n in enumerate(x.shape):
    if a in sizes:
      shape += [n // sizes[a], sizes[a]]
      inner.append(len(shape) - 1)
    else:
      shape.append(n)
  return x.reshape(shape), tuple(inner)


def _merge(xb: jax.Array, shape: tuple[int, ...], blocks) -> jax.Array:
  """Inverse of _split for an array of per-element values (padding sliced off)."""
  sizes = dict(blocks)
  padded = [n + (-n % sizes.get(a, 1)) for a, n in enumerate(shape)]
  return xb.reshape(padded)[tuple(slice(0, n) for n in shape)]


def _block_amax(x: jax.Array, blocks) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
  """x split into blocks, and each block's amax: NaN for a block holding Inf or NaN."""
  xb, inner = _split(x.astype(jnp.float32), blocks)
  amax = jnp.max(jnp.abs(xb), axis=inner, keepdims=True)
  # NaN if the block holds a NaN, said explicitly: XLA:CPU's vectorised max reduction skips NaNs
  # (its fast min/max), so the max alone gives the NaN on some shapes and not on others. (A NaN mapped
  # to Inf inside the one max reduction made XLA:GPU transpose the activations before reducing them
  # along rows: 1.6x slower.)
  amax = jnp.where(jnp.all(jnp.isfinite(xb), axis=inner, keepdims=True), amax, jnp.nan)
  return xb, amax, inner


def _to_e4m3(v: jax.Array) -> jax.Array:
  # Clamp first: a plain cast rounds values past 464 to NaN (e4m3fn has no Inf).
  return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(E4M3)


# ---- mxfp8 ----
def _pow2(n: jax.Array) -> jax.Array:
  """2.0^n in float32 for integer n in [-126, 127], built from the exponent bits (exact, and much cheaper
  than jnp.ldexp on CPU)."""
  return jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)


def _floor_log2(a: jax.Array) -> jax.Array:
  """floor(log2(a)) for finite a > 0 in float32: the unbiased exponent; subnormals give -127."""
  return ((jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF) - 127


def mx_quantize(x: jax.Array, axis: int = -1, block: int = MX_BLOCK) -> Quantized:
  """MXFP8: blocks of `block` consecutive elements along `axis`."""
  blocks = _norm({axis: block}, x.ndim)
  xb, amax, inner = _block_amax(x, blocks)
  # floor(log2 amax) - 8, at least -127; a subnormal or zero amax lands on -127. At most 119 for finite
  # float32, so the multiplier 2^-shared below is a normal float.
  shared = jnp.maximum(_floor_log2(amax) - E4M3_EMAX, E8M0_MIN_EXP)
  shared = jnp.where(amax == 0, E8M0_MIN_EXP, shared)
  bad = ~jnp.isfinite(amax)
  q = _to_e4m3(xb * _pow2(jnp.minimum(-shared, 127)))  # exact: a power-of-two scaling
  q = jnp.where(bad, jnp.nan, q.astype(jnp.float32)).astype(E4M3)
  # e8m0 holds 2^e for e in [-127, 127] as the byte e + 127, and NaN as 0xFF. Built from the bits:
  # 2^-127 is an fp32 subnormal, which a float cast may flush.
  scale = jax.lax.bitcast_convert_type(jnp.where(bad, 255, shared + 127).astype(jnp.uint8), E8M0)
  return Quantized(_merge(q, x.shape, blocks), jnp.squeeze(scale, inner), blocks)


# ---- fp8 blockwise (DeepSeek-V3) ----
def blockwise_quantize(x: jax.Array, blocks: dict[int, int]) -> Quantized:
  """e4m3 with an fp32 scale amax/448 per block; `blocks` maps axis -> block size."""
  blocks = _norm(blocks, x.ndim)
  xb, amax, inner = _block_amax(x, blocks)
  scale = blockwise_scale(amax)
  q = _to_e4m3(xb * (1.0 / scale))
  q = jnp.where(jnp.isfinite(scale), q.astype(jnp.float32), jnp.nan).astype(E4M3)
  return Quantized(_merge(q, x.shape, blocks), jnp.squeeze(scale, inner), blocks)


def activation_quantize(x: jax.Array, axis: int = -1) -> Quantized:
  """1x128 tiles along `axis` (the contraction axis)."""
  return blockwise_quantize(x, {axis: FP8_BLOCK})


WEIGHT_BLOCKS = ((1, FP8_BLOCK), (2, FP8_BLOCK))  # weight_quantize's blocks of w [G, K, N]


def weight_quantize(w: jax.Array) -> Quantized:
  """128x128 blocks over the last two axes of w [..., K, N]."""
  return blockwise_quantize(w, {w.ndim - 2: FP8_BLOCK, w.ndim - 1: FP8_BLOCK})


# ---- both ----
def expand_scale(scale: jax.Array, shape: tuple[int, ...], blocks) -> jax.Array:
  """Per-block values broadcast to per-element values of `shape`."""
  for axis, block in blocks:
    scale = jnp.repeat(scale, block, axis=axis, total_repeat_length=scale.shape[axis] * block)
  return scale[tuple(slice(0, n) for n in shape)]


def mx_exponent(scale: jax.Array) -> jax.Array:
  """e8m0 scales as int32 exponents; 128 stands for the NaN scale."""
  return jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32) - 127


def dequantize(qt: Quantized, dtype=jnp.float32) -> jax.Array:
  q = qt.q.astype(jnp.float32)
  if qt.scale.dtype == E8M0:  # exact power-of-two scaling, NaN for the NaN scale
    e = expand_scale(mx_exponent(qt.scale), q.shape, qt.blocks)
    # 2^-127 is subnormal: multiply by 2^-126 then by 1/2.
    value = q * _pow2(jnp.clip(e, -126, 127)) * jnp.where(e == -127, 0.5, 1.0)
    return jnp.where(e == 128, jnp.nan, value).astype(dtype)
  return (q * expand_scale(qt.scale.astype(jnp.float32), q.shape, qt.blocks)).astype(dtype)


def fake_quantize(x: jax.Array, quantize, *args) -> jax.Array:
  """x through quantise then dequantise, in x's dtype (the emulated numerics)."""
  return dequantize(quantize(x, *args), x.dtype)
