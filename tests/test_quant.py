"""Quantised expert GEMMs (MaxText/quant/ formats, MaxText/gmm/ GEMMs): the formats against NumPy references written
here, the grouped GEMMs (CPU path, and the Mosaic kernels in Pallas' GPU interpreter) against float references,
straight-through gradients, config errors, and short training runs against unquantised ones (the 300-step tiny recipe
is opt-in: MAXTEXT_QUANT_CONVERGENCE=1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import gmm
from MaxText.gmm import fp8_blockwise, mxfp8, mxfp8_block_scaled
from MaxText.gmm.base import kernels_from_vjp
from MaxText.kernels import triton_quantize
from MaxText.quant import formats, groups

# ---- NumPy references of the formats ----
E4M3_MAX = 448.0


def np_e4m3(v: np.ndarray) -> np.ndarray:
  """Round float64 values to the e4m3fn grid, nearest-even, saturating at 448 (3 mantissa bits,
  normal exponents -6..8, subnormal step 2^-9)."""
  a = np.minimum(np.abs(v), E4M3_MAX)
  e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6)
  step = 2.0 ** (e - 3)
  return np.sign(v) * np.minimum(np.round(a / step) * step, E4M3_MAX)  # np.round: half to even


def np_mx(x: np.ndarray, block=32):
  """OCP MX v1.0 MXFP8 along the last axis: (dequantised values, scale exponents; 128 marks the NaN scale).

  Per block: X = 2^(floor(log2(amax)) - 8) clipped to [2^-127, 2^127] (2^-127 for an all-zero block),
  elements round(x / X) on the e4m3 grid, saturating at 448; a block with Inf or NaN is all NaN."""
  x = np.asarray(x, np.float64)
  n = x.shape[-1]
  xb = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % block)]).reshape(*x.shape[:-1], -1, block)
  with np.errstate(invalid="ignore", divide="ignore"):
    amax = np.max(np.abs(xb), axis=-1, keepdims=True)
    finite = np.isfinite(amax)
    e = np.where(amax > 0, np.floor(np.log2(np.where(finite & (amax > 0), amax, 1.0))) - 8, -127)
  e = np.clip(e, -127, 127)
  out = np.where(finite, np_e4m3(np.where(finite, xb, 0.0) / 2.0**e) * 2.0**e, np.nan)
  exps = np.where(finite, e, 128)[..., 0].astype(np.int64)
  return out.reshape(*x.shape[:-1], -1)[..., :n], exps


def np_blockwise(x: np.ndarray, block_shape: tuple[int, int]):
  """DeepSeek-V3 blocks over the last two axes: (dequantised values, float32 scales amax * fp32(1/448), at
  least 2^-126); elements v * (1/scale), the reciprocal and the product rounded to float32."""
  x = np.asarray(x, np.float32)
  bm, bn = block_shape
  m, n = x.shape[-2:]
  out = np.zeros(x.shape, np.float64)
  scales = np.zeros((*x.shape[:-2], -(-m // bm), -(-n // bn)), np.float32)
  for idx in np.ndindex(*x.shape[:-2]):
    for i, j in np.ndindex(*scales.shape[-2:]):
      sl = (*idx, slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
      v = x[sl]
      amax = np.max(np.abs(v))
      if not np.isfinite(amax):
        scales[(*idx, i, j)], out[sl] = np.nan, np.nan
        continue
      s = np.float32(1.0) if amax == 0 else max(np.float32(amax) * np.float32(1 / E4M3_MAX), np.float32(2.0**-126))
      scales[(*idx, i, j)] = s
      out[sl] = np_e4m3((v * (np.float32(1) / s)).astype(np.float64)) * np.float64(s)  # the product in float32
  return out, scales


def awkward_values(shape, seed=0) -> np.ndarray:
  """Normal values with a different power-of-two range per 8 columns, exact zeros, tiny values, values
  that e4m3 saturates on (amax mantissa >= 1.75), and the odd huge one."""
  rng = np.random.default_rng(seed)
  x = (
    rng.normal(size=shape)
    * 2.0 ** rng.integers(-30, 30, size=(*shape[:-1], -(-shape[-1] // 8))).repeat(8, -1)[..., : shape[-1]]
  )
  x[..., :3] = 0.0
  x[..., 3] = 1.9 * 2.0**5  # saturates: its block's amax/X lies in [448, 512)
  x[..., 5] = 1e-38
  return x.astype(np.float32)


# ---- formats ----
def test_mxfp8_matches_numpy_reference_including_zeros_saturation_and_specials():
  x = awkward_values((6, 100))
  x[1, 32:64] = 0.0  # an all-zero block
  x[2, 40], x[3, 70], x[4, 99] = np.inf, -np.inf, np.nan
  qt = formats.mx_quantize(jnp.asarray(x), axis=1)
  want, want_exp = np_mx(x)
  assert qt.q.dtype == jnp.float8_e4m3fn and qt.scale.dtype == jnp.float8_e8m0fnu and qt.scale.shape == (6, 4)
  np.testing.assert_array_equal(np.asarray(formats.mx_exponent(qt.scale)), want_exp)
  got = np.asarray(formats.dequantize(qt), np.float64)
  np.testing.assert_array_equal(got, want.astype(np.float32))  # NaN where NaN, exact elsewhere
  assert want_exp[1, 1] == -127 and np.all(got[1, 32:64] == 0)
  assert np.isnan(got[2, 32:64]).all() and np.isnan(got[3, 64:96]).all() and np.isnan(got[4, 96:]).all()
  assert np.isfinite(got[2, :32]).all()  # other blocks of the row are untouched
  # saturation happened somewhere (the value at column 3 sits at 1.9 x its block's power of two)
  assert np.any(np.abs(got[:, 3]) < np.abs(x[:, 3]) * 0.95)
  # along another axis, and from bf16
  xb = jnp.asarray(x[:, :64].T, jnp.bfloat16)
  got_b = formats.dequantize(formats.mx_quantize(xb, axis=0))
  np.testing.assert_array_equal(
    np.asarray(got_b, np.float32).T,
    np_mx(np.asarray(xb, np.float32).T)[0].astype(np.float32).astype(jnp.bfloat16).astype(np.float32),
  )


def test_fp8_blockwise_matches_numpy_reference_for_activations_and_weights():
  x = awkward_values((5, 300), seed=1)
  x[0, :128] = 0.0
  x[1, 200], x[2, 10] = np.inf, np.nan
  x[3, 128:256] = tiny = np.linspace(2e-38, 1e-37, 128, dtype=np.float32) * (-1) ** np.arange(
    128
  )  # amax/448 below 2^-126: the floor
  qt = formats.activation_quantize(jnp.asarray(x), axis=1)
  want, want_scale = np_blockwise(x, (1, 128))
  assert qt.scale.dtype == jnp.float32 and qt.scale.shape == (5, 3)
  np.testing.assert_array_equal(np.asarray(qt.scale), want_scale[:, :, 0] if want_scale.ndim == 3 else want_scale)
  np.testing.assert_array_equal(np.asarray(formats.dequantize(qt)), want.astype(np.float32))
  assert float(qt.scale[3, 1]) == 2.0**-126 and np.all(np.asarray(formats.dequantize(qt))[3, 128:256][tiny != 0] != 0)
  assert (
    float(qt.scale[0, 0]) == 1.0
    and np.isnan(np.asarray(qt.scale[1, 1]))
    and np.isnan(np.asarray(formats.dequantize(qt))[2, :128]).all()
  )
  # A NaN in a larger array: XLA:CPU's vectorised max reduction skips NaNs, the format must not
  big = np.ones((300, 256), np.float32)
  big[200, 130] = np.nan
  for q in (formats.activation_quantize(jnp.asarray(big), 1), formats.mx_quantize(jnp.asarray(big), 1)):
    assert (
      np.isnan(np.asarray(formats.dequantize(q))[200, 128:160]).all()
      and not np.isnan(np.asarray(formats.dequantize(q))[199]).any()
    )

  w = awkward_values((2, 200, 260), seed=2)
  wq = formats.weight_quantize(jnp.asarray(w))
  want, want_scale = np_blockwise(w, (128, 128))
  assert wq.scale.shape == (2, 2, 3)
  np.testing.assert_array_equal(np.asarray(wq.scale), want_scale)
  np.testing.assert_array_equal(np.asarray(formats.dequantize(wq)), want.astype(np.float32))


def test_group_alignment_keeps_rows_and_starts_groups_on_block_boundaries():
  sizes = jnp.array([5, 0, 40, 1, 33], jnp.int32)
  a = groups.align_groups(sizes, 90, 32)  # 79 real rows, 11 padding rows
  assert a.padded_rows % 32 == 0 and a.padded_rows >= 90
  np.testing.assert_array_equal(a.group_sizes, [32, 0, 64, 32, 64])
  x = jnp.arange(90, dtype=jnp.float32)[:, None] + 1
  xa = groups.to_aligned(x, a)
  starts = np.cumsum([0, 32, 0, 64, 32])
  for g, (start, size) in enumerate(zip(starts, [5, 0, 40, 1, 33])):
    first = int(np.sum([5, 0, 40, 1, 33][:g]))
    np.testing.assert_array_equal(xa[start : start + size, 0], np.arange(first, first + size) + 1)
  assert float(xa.sum()) == float(x[:79].sum())  # padding rows dropped, zeros elsewhere
  np.testing.assert_array_equal(groups.from_aligned(xa, a)[:79], x[:79])
  assert float(groups.from_aligned(xa, a)[79:].sum()) == 0.0


# ---- grouped GEMMs ----
SIZES = {"balanced": [40, 40, 40, 40], "uneven": [70, 0, 57, 23], "one group": [0, 150, 0, 0]}  # 160 rows


def _operands(seed=0, m=160, k=200, n=136, g=4):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (
    jax.random.normal(ks[0], (m, k)),
    jax.random.normal(ks[1], (g, k, n)) / np.sqrt(k),
    jax.random.normal(ks[2], (m, n)),
  )


def _np_rows_quantized(a: np.ndarray, sizes, quantize_rows) -> np.ndarray:
  """a's rows dequantised in blocks along rows that restart at every group (the wgrad contraction)."""
  out = np.zeros_like(a, np.float64)
  start = 0
  for s in sizes:
    if s:
      out[start : start + s] = quantize_rows(a[start : start + s])
    start += s
  return out


def _np_grouped(sizes, fill, shape):
  out = np.zeros(shape)
  start = 0
  for g, s in enumerate(sizes):
    fill(out, g, slice(start, start + s))
    start += s
  return out


def _references(fmt, x, w, dy, sizes):
  """y, dx, dw from the NumPy-dequantised operands (float64): what the quantised GEMMs must equal up to
  fp32 accumulation, since products of e4m3 values are exact and the scales only rescale blocks."""
  x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
  if fmt == "mxfp8":
    xk = np_mx(x)[0]
    wk = np.swapaxes(np_mx(np.swapaxes(w, 1, 2))[0], 1, 2)
    dyn = np_mx(dy)[0]
    wn = np_mx(w)[0]
    rows = lambda a: np_mx(a.T)[0].T  # noqa: E731
  else:
    xk = np_blockwise(x, (1, 128))[0]
    wk = wn = np_blockwise(w, (128, 128))[0]
    dyn = np_blockwise(dy, (1, 128))[0]
    rows = lambda a: np_blockwise(a.T, (1, 128))[0].T  # noqa: E731
  xr, dyr = _np_rows_quantized(x, sizes, rows), _np_rows_quantized(dy, sizes, rows)
  m, n, k = x.shape[0], w.shape[2], w.shape[1]

  def fill_y(out, g, r):
    out[r] = xk[r] @ wk[g]

  def fill_dx(out, g, r):
    out[r] = dyn[r] @ wn[g].T

  def fill_dw(out, g, r):
    out[g] = xr[r].T @ dyr[r]

  return _np_grouped(sizes, fill_y, (m, n)), _np_grouped(sizes, fill_dx, (m, k)), _np_grouped(sizes, fill_dw, w.shape)


def _run(f, x, w, dy, sizes):
  y, pullback = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
  return (y, *pullback(dy))


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8:block_scaled", "fp8_blockwise"])
@pytest.mark.parametrize("case", SIZES)
def test_quantized_grouped_gemm_forward_dgrad_wgrad(fmt, case):
  """Two bounds. (1) Exactness of the scaled GEMM: every output equals the product of the NumPy-dequantised
  operands (quantised along each GEMM's own contraction: K forward, N for dgrad, rows per group for wgrad)
  to fp32 accumulation accuracy, rel 1e-5: a wrong scale, block or group boundary is off by far more.
  (2) Against the unquantised float32 product, relative Frobenius error < 0.06: e4m3 keeps 3 mantissa
  bits, so each element is off by at most 2^-4 relatively (MX's clamp at 448 can reach 1/8 on a block's
  largest elements); for random operands the relative errors are roughly uniform, RMS ~2^-4/sqrt(3)/sqrt(2)
  per operand, ~0.035 for a product of two, which 0.06 covers with margin at these sizes."""
  sizes_list = SIZES[case]
  sizes = jnp.array(sizes_list, jnp.int32)
  x, w, dy = _operands()
  valid = sum(sizes_list)
  dy = dy.at[valid:].set(0.0)
  name = fmt.partition(":")[0]
  y, dx, dw = _run(gmm.build(fmt if ":" in fmt else f"{fmt}:xla"), x, w, dy, sizes)
  want_y, want_dx, want_dw = _references(name, x, w, dy, sizes_list)
  for got, want in ((y[:valid], want_y[:valid]), (dx[:valid], want_dx[:valid]), (dw, want_dw)):
    assert np.all(np.isfinite(np.asarray(got)))
    assert _rel(got, want) < 1e-5
  ref_y, ref_pullback = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
  ref_dx, ref_dw = ref_pullback(dy)
  for got, want in ((y[:valid], ref_y[:valid]), (dx[:valid], ref_dx[:valid]), (dw, ref_dw)):
    assert _rel(got, want) < 0.06
  # straight-through: the gradients are those of the unquantised product up to that error, not zero
  assert _rel(dw, ref_dw) > 1e-3 and float(jnp.abs(dx[:valid]).sum()) > 0


def test_mxfp8_on_another_backend_uses_its_vjp_and_agrees():
  x, w, dy = _operands(seed=3)
  sizes = jnp.array([70, 0, 57, 33], jnp.int32)
  via_xla = _run(gmm.build("mxfp8:xla"), x, w, dy, sizes)
  generic = mxfp8.make_gmm(*kernels_from_vjp(jax.lax.ragged_dot))
  via_vjp = _run(generic, x, w, dy, sizes)
  for a, b in zip(via_xla, via_vjp):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_block_scaled_windows_cover_every_group_row_once():
  """The window table of mxfp8_impl=block_scaled: each group cut into windows of its own rows, no window
  past `count` doing work, and the static bound never short."""
  sizes = np.array([0, 300, 5, 0, 1024, 128], np.int32)
  rows, window = 1500, 128
  total = mxfp8_block_scaled.max_windows(rows, len(sizes), window)
  starts = np.cumsum(sizes) - sizes
  w = mxfp8_block_scaled.windows(jnp.asarray(starts), jnp.asarray(sizes), window, total)
  count = int(w.count)
  assert count == sum(-(-int(s) // window) for s in sizes) <= total
  covered = np.zeros(rows, np.int32)
  for start, g, n in zip(np.asarray(w.start)[:count], np.asarray(w.group)[:count], np.asarray(w.rows)[:count]):
    assert 0 < n <= window and starts[g] <= start and start + n <= starts[g] + sizes[g]
    covered[start : start + n] += 1
  np.testing.assert_array_equal(covered[: sizes.sum()], 1)
  assert not covered[sizes.sum() :].any() and not np.asarray(w.rows)[count:].any()
  # window sizes: a quarter of a group's share, a power of two in [128, 1024]
  assert [mxfp8_block_scaled.window_rows(r, g) for r, g in ((160, 4), (32768, 8), (32768, 32), (65536, 2))] == [
    128,
    1024,
    256,
    1024,
  ]


def test_block_scaled_wgrad_keeps_a_nan_block_in_its_own_group():
  """A window's rows of the next group are zeroed with their scales: an Inf in group 2's dy makes
  dw[2] NaN and leaves the other groups' gradients as the emulation computes them (a zeroed value under a
  NaN scale would still be NaN), with groups narrower than a window (160 rows: windows of 128)."""
  x, w, dy = _operands(seed=5)
  sizes = jnp.array([20, 50, 40, 50], jnp.int32)
  dy = dy.at[75, 3].set(jnp.inf)  # row 75: group 2 (rows 70..109)
  got = mxfp8_block_scaled.wgrad(x, dy, sizes)
  want = gmm.build("mxfp8:xla")
  _, pullback = jax.vjp(lambda w: want(x, w, sizes), w)
  want_dw = pullback(dy)[0]
  assert np.isnan(np.asarray(got[2])).any()
  for g in (0, 1, 3):
    np.testing.assert_allclose(got[g], want_dw[g], rtol=1e-5, atol=1e-5)


def test_mxfp8_impl_resolution_and_log_line():
  class Gpu:
    platform, device_kind = "gpu", "NVIDIA B200"

    def __init__(self, capability):
      self.compute_capability = capability

  cpu = jax.devices()[0]
  assert gmm.resolve_mxfp8("auto", cpu) == "emulated"
  assert gmm.resolve_mxfp8("auto", Gpu("9.0")) == "emulated"
  assert gmm.resolve_mxfp8("auto", Gpu("10.0")) == "block_scaled"
  assert gmm.resolve_mxfp8("auto", Gpu("12.0")) == "block_scaled"
  assert gmm.resolve_mxfp8("block_scaled", cpu) == "block_scaled"
  assert gmm.resolve_mxfp8("emulated", Gpu("10.0")) == "emulated"
  assert "tensor-core block scales" in gmm.describe("mxfp8:block_scaled", device=Gpu("10.0"))
  assert "dequantised by XLA first: cpu has no block-scaled MMA" in gmm.describe("mxfp8:block_scaled", device=cpu)
  assert "dequantised into the xla bf16 GEMM" in gmm.describe("mxfp8:xla")
  assert "fp8_blockwise only: ignored" in gmm.describe("mxfp8:xla")


@pytest.mark.parametrize("widths", ["wide", "128"])
def test_fp8_mosaic_kernels_match_the_reference_in_gpu_interpret_mode(widths, capfd):
  """The Hopper kernels themselves (fp8 wgmma, in-kernel scales, ragged row stores, per-group wgrad),
  run by Pallas' Mosaic GPU interpreter on CPU, against the jnp blockwise reference, with the interpreter's
  race detector on (a producer warpgroup, two consumers on 128-row tiles). "wide": the training tiles
  (256-wide forward and dgrad); "128": 128-wide tiles, the wgrad without its overlapped promotion.
  n = 136 gives two 128-wide weight-scale blocks, the second partly padding. K steps: 3 in the forward
  (k = 300), 2 in the dgrad; 1, 0, 3 and 1 row blocks per group in the wgrad (the overlap runs its K
  steps in pairs: pairs, a pair and a last step, a last step alone, none)."""
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  x, w, dy = _operands(seed=4, m=340, k=300, n=136)
  sizes = jnp.array([60, 0, 261, 4], jnp.int32)  # 325 rows: 15 padding rows, a group of 4, one empty
  tiles = {} if widths == "wide" else {"block_n": 128, "wgrad": {"overlap_promotion": False}}
  # 2 stages, so that the ring of buffers is reused within and across tiles
  interpret = plgpu.InterpretGPUParams(detect_races=True)
  kernels = fp8_blockwise.MosaicKernels(**tiles, max_concurrent_steps=2, interpret=interpret)
  got = _run(fp8_blockwise.Fp8BlockwiseGemm("test", kernels), x, w, dy, sizes)
  want = _run(gmm.build("fp8_blockwise:xla"), x, w, dy, sizes)
  for a, b in zip((got[0][:325], got[1][:325], got[2]), (want[0][:325], want[1][:325], want[2])):
    assert _rel(a, b) < 1e-5
  assert "RACE DETECTED" not in capfd.readouterr().out  # the detector prints each race it finds


def test_quantize_kernels_match_the_jnp_format_in_interpret_mode():
  """The single-pass quantisation kernels (Triton; here in Pallas' interpreter) write exactly what formats.py
  computes: weights' 128x128 blocks with the transposed copy, and activations in 1x128 tiles along K plus
  their rows aligned per group in 128x1 tiles, row-block-major; zero, Inf and NaN blocks, an empty group and
  rows past the groups' total included. (Bit-exactness on the GPU: tests/gpu/check_quantize_kernels.py.)"""

  def same(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)

  w = awkward_values((2, 256, 384), seed=3)
  w[0, :128, :128], w[1, 5, 300], w[0, 200, 10] = 0.0, np.nan, np.inf
  wq = fp8_blockwise.MosaicKernels(interpret=True).weight_quantize(jnp.asarray(w))
  want = formats.weight_quantize(jnp.asarray(w))
  assert (
    same(wq.q, want.q)
    and same(wq.scale, want.scale)
    and same(wq.q_t, jnp.swapaxes(want.q, 1, 2))
    and wq.blocks == want.blocks
  )
  assert np.isnan(np.asarray(wq.scale)[1, 0, 2]) and float(wq.scale[0, 0, 0]) == 1.0

  x = jnp.asarray(awkward_values((1000, 256), seed=4)).at[3, 7].set(jnp.nan).at[600:700, :].set(0.0)
  sizes = jnp.array([100, 0, 517, 300], jnp.int32)  # 83 rows past the total
  aligned = fp8_blockwise.align_all_rows(sizes, 1000)
  kernels = fp8_blockwise.MosaicKernels(interpret=True)
  rows, cols = kernels.quantize_both(x, aligned)
  want_rows = formats.activation_quantize(x, 1)
  want_cols = formats.blockwise_quantize(groups.to_aligned(x, aligned), {0: 128})
  assert same(rows.q, want_rows.q) and same(rows.scale, want_rows.scale)
  assert same(cols.q, fp8_blockwise.rows_block_major(want_cols.q)) and same(cols.scale, want_cols.scale)
  assert np.isnan(np.asarray(rows.scale)[3, 0]) and not np.isnan(np.asarray(rows.scale)[4]).any()
  # the wgrad operand requantised from the fp8 rows (quantize_before_permute), through bf16 as the layer does
  got = kernels.columns_from_rows(want_rows, aligned, jnp.bfloat16)
  want_cols = fp8_blockwise.columns_from_rows(want_rows, aligned, jnp.bfloat16)
  assert same(got.q, fp8_blockwise.rows_block_major(want_cols.q)) and same(got.scale, want_cols.scale)
  # swiglu(gate, up) made in the kernel from [gate | up] (quantize_with_activation), as the jnp path quantises it
  gate_up = (
    jnp.asarray(awkward_values((1000, 512), seed=6), jnp.bfloat16).at[9, 300].set(jnp.nan).at[640, 20].set(-jnp.inf)
  )
  rows, cols = kernels.swiglu_quantize_both(gate_up[:, :256], gate_up[:, 256:], aligned)
  want_rows, want_cols = fp8_blockwise.ReferenceKernels().swiglu_quantize_both(
    gate_up[:, :256], gate_up[:, 256:], aligned
  )
  assert rows.q.shape == (1000, 256) and same(rows.q, want_rows.q) and same(rows.scale, want_rows.scale)
  assert same(cols.q, fp8_blockwise.rows_block_major(want_cols.q)) and same(cols.scale, want_cols.scale)
  assert np.isnan(np.asarray(rows.scale)[9, 0]) and np.isnan(
    np.asarray(rows.scale)[640, 0]
  )  # up's NaN; silu(-inf) * up


def test_fused_quantisation_runs_the_kernels_in_the_gemm(monkeypatch):
  """The Mosaic kernel set as training runs it (Triton quantisation feeding the Mosaic kernels, both
  interpreted; a 256-wide forward tile, and the dgrad's 384 columns on 128-wide tiles rather than padded),
  against the jnp reference GEMM, forward, dgrad and wgrad; widths in whole 128-blocks so the fused kernels
  are taken."""
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  x, w, dy = _operands(seed=5, m=300, k=384, n=256, g=3)
  sizes = jnp.array([130, 0, 150], jnp.int32)  # 20 rows past the total
  kernels = fp8_blockwise.MosaicKernels(max_concurrent_steps=2, interpret=plgpu.InterpretGPUParams())
  calls = []
  for name in ("weight_quantize_both", "quantize_rows_and_columns", "columns_from_rows"):
    kernel = getattr(triton_quantize, name)
    monkeypatch.setattr(
      triton_quantize, name, lambda *a, kernel=kernel, name=name, **kw: calls.append(name) or kernel(*a, **kw)
    )
  f, ref = fp8_blockwise.Fp8BlockwiseGemm("test", kernels), gmm.build("fp8_blockwise:xla")
  got = _run(f, x, w, dy, sizes)
  # w once (the backward reads its forward quantisation), x in the forward and dy in the backward
  assert sorted(calls) == ["quantize_rows_and_columns"] * 2 + ["weight_quantize_both"], calls
  want = _run(ref, x, w, dy, sizes)
  for a, b in zip((got[0][:280], got[1][:280], got[2]), (want[0][:280], want[1][:280], want[2])):
    assert _rel(a, b) < 1e-5
  # rows quantised before the permute: the weight gradient's x operand is requantised from the fp8 rows
  calls.clear()
  got = _run(lambda x, w, s: f.from_quantized_rows(x, f.quantize_rows(x), w, s), x, w, dy, sizes)
  assert sorted(calls) == ["columns_from_rows", "quantize_rows_and_columns", "weight_quantize_both"], calls
  want = _run(lambda x, w, s: ref.from_quantized_rows(x, ref.quantize_rows(x), w, s), x, w, dy, sizes)
  for a, b in zip((got[0][:280], got[1][:280], got[2]), (want[0][:280], want[1][:280], want[2])):
    assert _rel(a, b) < 1e-5


def _swiglu_operands(seed, m, f, k, g):
  ks = jax.random.split(jax.random.key(seed), 4)
  gate, up = (jax.random.normal(key, (m, f)).astype(jnp.bfloat16) for key in ks[:2])
  return (
    gate,
    up,
    jax.random.normal(ks[2], (g, f, k)) / np.sqrt(f),
    jax.random.normal(ks[3], (m, k)).astype(jnp.bfloat16),
  )


def _swiglu_run(f, gate, up, w, dy, sizes):
  y, pullback = jax.vjp(lambda gate, up, w: f(gate, up, w, sizes), gate, up, w)
  return (y, *pullback(dy))


def test_swiglu_down_gemm_is_the_gemm_of_the_activation():
  """gemm.swiglu_down(gate, up, w) (quantize_with_activation) is gemm(swiglu(gate, up), w): the same value and
  the same gradients for gate, up and w, bit for bit on the jnp kernels, whose quantisation of the
  activation it shares; and swiglu is silu(gate) * up in float32 rounded once."""
  gate, up, w, dy = _swiglu_operands(seed=7, m=300, f=256, k=136, g=3)
  sizes = jnp.array([130, 0, 150], jnp.int32)
  f = gmm.build("fp8_blockwise:xla")
  got = _swiglu_run(f.swiglu_down, gate, up, w, dy, sizes)
  want = _swiglu_run(lambda gate, up, w, s: f(triton_quantize.swiglu(gate, up), w, s), gate, up, w, dy, sizes)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  assert all(np.any(np.asarray(a, np.float32) != 0) for a in got)
  h = triton_quantize.swiglu(gate, up)
  assert h.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(h, np.float32), np.asarray(jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)), rtol=2**-8
  )


def test_swiglu_down_gemm_runs_the_activation_in_the_quantisation_kernel(monkeypatch):
  """With the Mosaic kernel set (interpreted) swiglu_down quantises swiglu(gate, up) in one
  kernel pass from [gate | up], and matches the jnp reference GEMM, forward and the three gradients."""
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  gate, up, w, dy = _swiglu_operands(seed=8, m=300, f=256, k=256, g=3)
  sizes = jnp.array([130, 0, 150], jnp.int32)  # 20 rows past the total
  kernels = fp8_blockwise.MosaicKernels(max_concurrent_steps=2, interpret=plgpu.InterpretGPUParams())
  calls = []
  kernel = triton_quantize.quantize_rows_and_columns
  monkeypatch.setattr(
    triton_quantize,
    "quantize_rows_and_columns",
    lambda *a, **kw: calls.append(kw.get("swiglu_of", False)) or kernel(*a, **kw),
  )
  got = _swiglu_run(fp8_blockwise.Fp8BlockwiseGemm("test", kernels).swiglu_down, gate, up, w, dy, sizes)
  assert sorted(calls) == [False, True], calls  # swiglu(gate, up) in the forward, dy in the backward
  want = _swiglu_run(gmm.build("fp8_blockwise:xla").swiglu_down, gate, up, w, dy, sizes)
  for a, b in zip(
    (got[0][:280], got[1][:280], got[2][:280], got[3]), (want[0][:280], want[1][:280], want[2][:280], want[3])
  ):
    assert _rel(a, b) < (
      2e-3 if a.dtype == jnp.bfloat16 else 1e-5
    )  # bf16: an output rounded one ulp apart here and there


def test_registry_and_config_errors(tiny_config):
  from MaxText.errors import UserError

  assert gmm.quantizations() == ("", "mxfp8", "fp8_blockwise")
  with pytest.raises(UserError, match="fp8_blockwise runs on moe_gmm_backend=mosaic or xla .got tokamax."):
    tiny_config("quantization=fp8_blockwise", "moe_gmm_backend=tokamax")
  with pytest.raises(
    UserError, match="quantization=mxfp8 runs on moe_gmm_backend=xla or mosaic or tokamax .got padded."
  ):
    tiny_config("quantization=mxfp8", "moe_gmm_backend=padded", "moe_dispatch=capacity", "capacity_factor=2.0")
  with pytest.raises(UserError, match="quantization"):
    tiny_config("quantization=fp4")
  assert "MXFP8 operands dequantised into the xla bf16 GEMM" in gmm.describe("mxfp8:xla")
  assert "block scales applied in the kernel" in gmm.describe("fp8_blockwise:mosaic")
  assert "fused: silu(gate) * up" in gmm.describe("fp8_blockwise:mosaic")
  assert "no fusions" in gmm.describe("fp8_blockwise:xla", gmm.Options(False, False))


# ---- training ----
def _train(cfg, steps, devices=None):
  from MaxText.data import SyntheticData
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:devices]))
  data = SyntheticData(cfg.data, trainer.global_batch, cfg.train.max_target_length, cfg.model.vocab_size)
  state, step = trainer.init_state(), trainer.jit_step()
  losses = []
  for i in range(steps):
    state, metrics = step(state, trainer.device_batch(data.batch(i)))
    losses.append(metrics["loss"])
  return np.array([float(v) for v in losses])


def _compare(tiny_config, steps, *overrides, devices=None):
  runs = {
    q: _train(tiny_config(f"steps={steps}", f"quantization={q}", *overrides), steps, devices)
    for q in gmm.quantizations()
  }
  window = max(10, steps // 10)
  report = {}
  for q in ("mxfp8", "fp8_blockwise"):
    report[q] = {
      "final": abs(runs[q][-window:].mean() / runs[""][-window:].mean() - 1),
      "mean": abs(runs[q].mean() / runs[""].mean() - 1),
    }
  print(
    "relative loss gaps",
    {q: {k: round(float(v), 5) for k, v in r.items()} for q, r in report.items()},
    "last-window losses",
    {q or "off": round(float(r[-window:].mean()), 4) for q, r in runs.items()},
    "first",
    round(float(runs[""][0]), 4),
  )
  return runs, report


def test_quantized_training_follows_unquantized(tiny_config):
  """CI-sized (compiling the step dominates): the tiny recipe cut to one dense and one MoE layer, no MTP,
  no remat, batch 8 x 32 tokens on one device, 80 steps; losses within 2% (last 10 steps, and all)."""
  small = (
    "per_device_batch_size=8",
    "max_target_length=32",
    "mtp_num_layers=0",
    "remat_policy=none",
    "base_num_decoder_layers=2",
  )
  runs, report = _compare(tiny_config, 80, *small, devices=1)
  assert runs[""][-10:].mean() < 0.8 * runs[""][:5].mean()  # it learned something
  for q, r in report.items():
    assert r["final"] < 0.02 and r["mean"] < 0.02, (q, r)


@pytest.mark.parametrize("dispatch", ["sort", "dense_a2a"])
def test_block_scaled_mxfp8_trains_as_the_emulation_does(tiny_config, dispatch):
  """mxfp8_impl=block_scaled against emulated: the same numerics (fp32 accumulation both), so two steps give
  the same losses and gradient norms, on 8 devices, under expert parallelism's shard_map too."""
  small = (
    "max_target_length=16",
    "per_device_batch_size=2",
    "learning_rate=1e-2",
    "remat_policy=none",
    "mtp_num_layers=0",
    "steps=2",
    "quantization=mxfp8",
    f"moe_dispatch={dispatch}",
  )
  runs = {impl: _train(tiny_config(*small, f"mxfp8_impl={impl}"), 2) for impl in ("emulated", "block_scaled")}
  np.testing.assert_allclose(runs["block_scaled"], runs["emulated"], rtol=1e-5)


@pytest.mark.skipif(
  not os.environ.get("MAXTEXT_QUANT_CONVERGENCE"), reason="300 steps x 3 runs: set MAXTEXT_QUANT_CONVERGENCE=1"
)
def test_tiny_recipe_300_steps_within_two_percent(tiny_config):
  """The tiny recipe as it is (128 sequences of 64 tokens a step), on one device: the same math as on 8
  (tests/test_train.py), without 8 virtual devices' collectives contending for 2 CPU cores."""
  runs, report = _compare(tiny_config, 300, "per_device_batch_size=128", devices=1)
  for q, r in report.items():
    assert r["final"] < 0.02 and r["mean"] < 0.02, (q, r)


# ---- GPU lowering ----
def _compile_for_gpu(*args: str) -> dict:
  """tests/compile_only/lower_fp8_for_gpu.py's results for `args`, run where the CUDA plugin is importable."""
  repo = Path(__file__).resolve().parents[1]
  site = Path(os.environ.get("MAXTEXT_GPU_AOT_SITE", repo / ".venv" / "gpu-aot"))
  if not (site / "jax_plugins").is_dir():
    pytest.skip(f"CUDA plugin not installed in {site}")
  env = {**os.environ, "PYTHONPATH": f"{site}:{repo}", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  script = repo / "tests" / "compile_only" / "lower_fp8_for_gpu.py"
  proc = subprocess.run(
    [sys.executable, str(script), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=900
  )
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1].removeprefix("RESULT "))


def test_fp8_blockwise_kernels_compile_for_h200():
  """Forward, dgrad and wgrad of fp8_blockwise:mosaic compile for a compile-only H200 (Mosaic GPU lowering
  checks the fp8 wgmma operand layouts, shared memory and TMA shapes) at DeepSeek-V3's gate/up shape, from
  bf16 rows, from rows quantised before the permute and (the down GEMM of swiglu(gate, up)) from [gate | up]
  split in two, which XLA must not copy back together for the kernel. (Widths and row counts that are not
  tile multiples run in the interpreter test above.)"""
  for shape, result in _compile_for_gpu("fp8_blockwise:mosaic", "4096x7168x4096x8").items():
    # fwd, dgrad and wgrad for the plain call, from_quantized_rows and swiglu_down; the Triton quantisation
    # kernels besides: the two weights, x, swiglu(gate, up), dy and the requantised fp8 rows, fewer where XLA
    # merges equal calls
    assert result.pop("triton_kernels") in range(6, 10), shape
    want = {
      "device_kind": "NVIDIA H200",
      "mosaic_kernels": 9,
      "fp8_operands": True,
      "scaled_dots": 0,
      "triton_gemm_fusions": 0,
      "bf16_concatenates": 0,
    }
    assert result == want, shape


@pytest.mark.parametrize("pad", [0, 8])
def test_tokens_quantised_before_the_permute(tiny_config, pad):
  """fp8_blockwise with quantize_before_permute: 1x128 scales along the hidden axis are per token, so
  quantising the tokens and permuting fp8 rows gives the same forward and input gradient as quantising the
  permuted rows; the expert weight gradients read the dequantised rows (requantised 128x1), so they differ
  by a second rounding only. Widths of 256 hold two scale blocks; pad adds zero padding rows per expert."""
  from MaxText import params
  from MaxText.moe.layer import moe, moe_specs
  from MaxText.sharding import Sharder

  over = ("quantization=fp8_blockwise", "moe_gmm_backend=xla", f"moe_group_pad_multiple={pad}", "base_emb_dim=256")
  before, after = tiny_config(*over), tiny_config(*over, "quantize_before_permute=false")
  p = params.initialize(moe_specs(256, before.moe), jax.random.key(0), jnp.float32, 0.1)
  x = jax.random.normal(jax.random.key(1), (2, 40, 256))
  bias = jnp.zeros((before.moe.num_experts,))

  def grads(cfg):
    out, f = jax.vjp(lambda p, x: moe(p, x, bias, cfg.moe, Sharder())[0], p, x)
    return out, *f(jax.random.normal(jax.random.key(2), out.shape))

  unquantised = grads(tiny_config(f"moe_group_pad_multiple={pad}", "base_emb_dim=256"))
  (y_b, dp_b, dx_b), (y_a, dp_a, dx_a) = grads(before), grads(after)
  np.testing.assert_array_equal(y_b, y_a)
  np.testing.assert_allclose(dx_b, dx_a, rtol=1e-6, atol=1e-6)
  for k in ("wi_0", "wi_1"):
    # One extra e4m3 rounding of x (~4% relative, independent of the first) adds in quadrature: measured
    # 7.1% against the unquantised gradient where quantising after the permute gives 6.6%.
    assert 0 < _rel(dp_b[k], dp_a[k]) < 0.06, k
    assert _rel(dp_b[k], unquantised[1][k]) < 1.15 * _rel(dp_a[k], unquantised[1][k]), k
  np.testing.assert_allclose(dp_b["wo"], dp_a["wo"], rtol=1e-6, atol=1e-6)  # its input is the activation, not the rows


def test_activation_quantised_with_the_down_gemm_input_in_the_layer(tiny_config, monkeypatch):
  """quantize_with_activation changes where silu(gate) * up is made (inside the down GEMM's quantisation)
  and nothing else: the layer's output and gradients equal those of quantising the written activation,
  up to silu's float32 rounding (the layer here runs in float32)."""
  from MaxText import params
  from MaxText.moe.layer import moe, moe_specs
  from MaxText.sharding import Sharder

  over = ("quantization=fp8_blockwise", "moe_gmm_backend=xla", "base_emb_dim=256", "base_moe_mlp_dim=256")
  fused, written = tiny_config(*over), tiny_config(*over, "quantize_with_activation=false")
  assert fused.moe.quantize_with_activation and not written.moe.quantize_with_activation
  p = params.initialize(moe_specs(256, fused.moe), jax.random.key(0), jnp.float32, 0.1)
  x = jax.random.normal(jax.random.key(1), (2, 40, 256))
  bias = jnp.zeros((fused.moe.num_experts,))
  seen, swiglu = [], fp8_blockwise.swiglu
  monkeypatch.setattr(fp8_blockwise, "swiglu", lambda *a: seen.append(1) or swiglu(*a))

  def grads(cfg):
    out, f = jax.vjp(lambda p, x: moe(p, x, bias, cfg.moe, Sharder())[0], p, x)
    return out, *f(jax.random.normal(jax.random.key(2), out.shape))

  (y_f, dp_f, dx_f) = grads(fused)
  assert seen  # the fused path ran
  (y_w, dp_w, dx_w) = grads(written)
  np.testing.assert_allclose(y_f, y_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx_f, dx_w, rtol=1e-5, atol=1e-6)
  for k in ("wi_0", "wi_1", "wo"):
    assert _rel(dp_f[k], dp_w[k]) < 1e-5, k


def test_block_scaled_mxfp8_compiles_to_triton_scaled_dots_for_b200():
  """On a compile-only B200 (sm_100) mxfp8 (auto: block_scaled) compiles its forward, dgrad and wgrad
  products to XLA scaled-dot ops with e4m3 operands, each in a Triton GEMM fusion (tt.dot_scaled: the
  tensor-core block-scaled MMA on sm_100), not to a dequantise + dot; on an H200 auto keeps the emulation
  (the three Mosaic bf16 kernels), and a forced block_scaled compiles as on the B200."""
  want = {
    ("b200", "mxfp8"): ("NVIDIA B200", 0, 3),
    ("h200", "mxfp8"): ("NVIDIA H200", 3, 0),
    ("h200", "mxfp8:block_scaled"): ("NVIDIA H200", 0, 3),
  }
  for (gpu, fmt), (kind, mosaic, scaled) in want.items():
    (result,) = _compile_for_gpu("--gpu", gpu, fmt, "4096x7168x2048x8").values()
    got = (
      result["device_kind"],
      result["mosaic_kernels"],
      result["scaled_dots"],
      result["triton_gemm_fusions"] >= result["scaled_dots"],
      result["fp8_operands"],
    )
    assert got == (kind, mosaic, scaled, True, True), (gpu, fmt, result)


def test_benchmark_labels_name_each_quantised_gmm(tmp_path):
  """benchmarks/grouped_gemm.py and gmm_profile.py take --quant as a quantization (what training resolves to
  on the device) or a registry entry name (gmm.EXPERT_GEMMS); anything else is one usage line and exit code 2
  listing the registry's quantised entries, and nothing written."""
  cpu = jax.devices("cpu")[0]
  quantised = {n for n, e in gmm.EXPERT_GEMMS.items() if e.quantization}
  assert {"fp8_blockwise:mosaic", "fp8_blockwise:xla", "mxfp8:xla", "mxfp8:block_scaled"} <= quantised
  assert gmm.resolve("mxfp8", "auto", "auto", cpu, "float32").name == "mxfp8:xla"  # auto on a CPU: emulated
  assert gmm.resolve("fp8_blockwise", "auto", "auto", cpu, "float32").name.startswith("fp8_blockwise:")
  repo = Path(__file__).resolve().parents[1]
  for script in ("gmm_profile.py", "grouped_gemm.py"):
    proc = subprocess.run(
      [
        sys.executable,
        str(repo / "benchmarks" / script),
        "--out",
        str(tmp_path / script),
        "--quant",
        "fp8_blockwise:wide",
      ],
      capture_output=True,
      text=True,
      cwd=repo,
      env={**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"},
      timeout=300,
    )
    assert proc.returncode == 2, (script, proc.stderr[-500:])
    assert "--quant fp8_blockwise:wide: choose from" in proc.stderr, (script, proc.stderr[-500:])
    assert all(n in proc.stderr for n in quantised), (script, proc.stderr[-500:])
    assert not (tmp_path / script).exists()
