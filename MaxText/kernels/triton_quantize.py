"""fp8_blockwise's quantisation passes as single-pass GPU kernels (Pallas Triton), for the Hopper GEMMs.

The fp8 wgmma reads both operands K-major, so each tensor is needed in two layouts:

  weight_quantize_both(w)          w [G, K, N] in 128x128 blocks -> q [G, K, N] (dgrad) and q^T [G, N, K]
                                   (forward), one read of w
  quantize_rows_and_columns(x, a)  x [rows, K] -> 1x128 tiles along K (forward/dgrad operand) and its rows
                                   aligned per group in 128x1 tiles, row-block-major [padded/128, K, 128]
                                   (wgrad operand), one read of x
  columns_from_rows(xq, a, dtype)  the same wgrad operand from x's fp8 rows (quantize_before_permute keeps
                                   only those), one read of the fp8 rows
  quantize_rows_and_columns(gate_up, a, swiglu_of=True)
                                   both layouts of swiglu(gate, up), the down GEMM's input, made in the
                                   kernel from [gate | up] (quantize_with_activation)

Written in jnp (formats.py) XLA runs these as separate amax reductions, quantisations and transposes
(about three passes over w and four over x). Numerics are formats.blockwise_quantize's, bit for bit:
scale amax * fp32(1/448) floored at 2^-126 (1 for an all-zero block, NaN for one holding Inf/NaN),
elements x * (1 / scale) with the reciprocal correctly rounded, clamped to +-448, rounded to nearest
even. tests/gpu/check_quantize_kernels.py checks that on the GPU, against XLA on the host CPU (XLA's own GPU
fusions are off by one e4m3 step in about one value in 10^8).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from MaxText.kernels.fp8_scale import E4M3, FP8_BLOCK, blockwise_scale

B = FP8_BLOCK
# Warps per 128x128 tile, the fastest of 4/8/16 on an H200: a weight tile is quantised once and its fp8
# values transposed; an activation tile twice, from its bf16 values and their transpose.
WEIGHT_WARPS = 8
ACTIVATION_WARPS = 4
SWIGLU_WARPS = (
  8  # the activation made in the kernel adds an exp and a division per element: 0.26 ms where 4 warps take 0.33
)


def _out(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """An output of `shape` typed as `like` inside shard_map (expert parallelism), where Pallas needs the
  outputs' varying mesh axes spelled out (check_vma)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None))


def supported(*dims: int) -> bool:
  """Whether the kernels take these widths: whole 128-blocks (DeepSeek-V3's 7168, 4096 and 2048 are)."""
  return all(d % B == 0 for d in dims)


def _reciprocal(scale: jax.Array, interpret: bool) -> jax.Array:
  if interpret:
    return 1.0 / scale
  # Triton's f32 division is approximate (div.full.f32); the format's reciprocal is correctly rounded.
  return plt.elementwise_inline_asm(
    "rcp.rn.f32 $0, $1;",
    args=[scale],
    constraints="=f,f",
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(scale.shape, jnp.float32)],
  )[0]


def _quantize(x: jax.Array, axis, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """x [128, 128] f32, blocks along `axis` (None: the whole tile) -> (e4m3 values, f32 scales [128] or [1, 1])."""
  # A NaN counts as Inf: one max reduction, whatever Triton's max does with NaN (formats.py checks finiteness
  # in a second reduction, which XLA fuses better; the scales come out the same).
  magnitude = jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))
  if axis is None:  # kept 2-D: Triton broadcasts [1, 1] to the tile, not a scalar
    amax = jnp.max(jnp.max(magnitude, axis=1)[None, :], axis=1)[:, None]
  else:
    amax = jnp.max(magnitude, axis=axis)
  scale = blockwise_scale(amax)  # the format's own definition: NaN where amax is Inf
  expand = (lambda v: v) if axis is None else (lambda v: jnp.expand_dims(v, axis))
  # No clamp and no NaN select (8% of the activation kernel's time): |x| <= amax makes |x * (1/scale)| at
  # most 448 plus a few ulps, which rounds to 448 (e4m3 overflows only from 464, and Triton's conversion
  # saturates besides), and a NaN scale's reciprocal turns the whole block into NaN, as the format says.
  return (x * expand(_reciprocal(scale, interpret))).astype(E4M3), scale


def _weight_kernel(w_ref, q_ref, qt_ref, s_ref, *, interpret: bool):
  q, scale = _quantize(w_ref[...].astype(jnp.float32), None, interpret)
  q_ref[...] = q
  qt_ref[...] = q.T
  s_ref[...] = scale


def weight_quantize_both(w: jax.Array, interpret: bool = False, num_warps: int = WEIGHT_WARPS):
  """w [G, K, N] (K, N multiples of 128) -> (q [G, K, N], scale [G, K/128, N/128]: formats.weight_quantize(w),
  and q transposed [G, N, K])."""
  g, k, n = w.shape
  block = pl.BlockSpec((None, B, B), lambda e, i, j: (e, i, j))
  q, qt, scale = pl.pallas_call(
    lambda *refs: _weight_kernel(*refs, interpret=interpret),
    out_shape=(_out((g, k, n), E4M3, w), _out((g, n, k), E4M3, w), _out((g, k // B, n // B), jnp.float32, w)),
    grid=(g, k // B, n // B),
    in_specs=[block],
    out_specs=(
      block,
      pl.BlockSpec((None, B, B), lambda e, i, j: (e, j, i)),
      pl.BlockSpec((None, 1, 1), lambda e, i, j: (e, i, j)),
    ),
    interpret=interpret,
    name="fp8_weight_quantize_both",
    compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
  )(w)
  return q, scale, qt


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up in float32, rounded once to gate's dtype: the down GEMM's input as fp8_blockwise makes it
  (in the quantisation kernel's registers, or in jnp where the kernel is not taken)."""
  g = gate.astype(jnp.float32)
  return (jax.nn.silu(g) * up.astype(jnp.float32)).astype(gate.dtype)


def _rows_and_columns_kernel(
  source_ref,
  x_ref,
  rows_q_ref,
  rows_s_ref,
  cols_q_ref,
  cols_s_ref,
  *,
  rows: int,
  swiglu_width: int | None,
  interpret: bool,
):
  block, j = pl.program_id(0), pl.program_id(1)
  source = source_ref[pl.ds(block * B, B)]  # the rows of x this aligned row block holds
  valid = source < rows  # the others (index `rows`) are the alignment's zero rows: masked, never touched
  columns = pl.ds(j * B, B)
  tile = (source[:, None], j * B + jnp.arange(B, dtype=jnp.int32)[None, :])  # gathered rows x columns
  x = plt.load(x_ref.at[tile], mask=valid[:, None], other=0)
  if swiglu_width is not None:  # x_ref holds [gate | up]: this tile is silu(gate) * up, never written in bf16
    up = plt.load(x_ref.at[tile[0], tile[1] + swiglu_width], mask=valid[:, None], other=0)
    x = swiglu(x, up)
  # The 128x1 tiles from the bf16 tile transposed (through shared memory, half the bytes of f32) and
  # reduced along its rows: 1.5x faster on an H200 than reducing along columns and transposing the
  # fp8 result (benchmarks/results/2026-12-04-h200-quantize-transposed).
  q, scale = _quantize(x.T.astype(jnp.float32), 1, interpret)
  cols_q_ref[block, columns, :] = q
  cols_s_ref[block, columns] = scale
  q, scale = _quantize(x.astype(jnp.float32), 1, interpret)
  plt.store(rows_q_ref.at[tile], q, mask=valid[:, None])
  plt.store(rows_s_ref.at[source, j], scale, mask=valid)


def _columns_from_rows_kernel(source_ref, q_ref, s_ref, cols_q_ref, cols_s_ref, *, rows: int, dtype, interpret: bool):
  block, j = pl.program_id(0), pl.program_id(1)
  source = source_ref[pl.ds(block * B, B)]
  valid = source < rows
  tile = (source[:, None], j * B + jnp.arange(B, dtype=jnp.int32)[None, :])
  # Masked lanes are zeroed after the load: Triton cannot fill an fp8 load with a constant.
  q = jnp.where(valid[:, None], plt.load(q_ref.at[tile], mask=valid[:, None]).astype(jnp.float32), 0.0)
  scale = plt.load(s_ref.at[source, j], mask=valid, other=0.0)
  x = (q * scale[:, None]).astype(dtype)  # formats.dequantize(.., dtype), then as x
  q, scale = _quantize(x.T.astype(jnp.float32), 1, interpret)  # transposed as in _rows_and_columns_kernel
  cols_q_ref[block, pl.ds(j * B, B), :] = q
  cols_s_ref[block, pl.ds(j * B, B)] = scale


def columns_from_rows(
  q: jax.Array, scale: jax.Array, source: jax.Array, dtype, interpret: bool = False, num_warps: int = ACTIVATION_WARPS
):
  """x's rows quantised in 1x128 tiles along K (q [rows, K], scale [rows, K/128]), dequantised to `dtype` and
  requantised as the aligned rows in 128x1 tiles, row-block-major (as quantize_rows_and_columns' second
  output): what DeepSeek-V3 does with its cached fp8 activations, reading the fp8 rows instead of x.
  source [padded rows]: the row each aligned row holds (`rows` for a zero row; quant/groups.py)."""
  rows, k = q.shape
  blocks = source.shape[0] // B
  out_shape = (_out((blocks, k, B), E4M3, q), _out((blocks, k), jnp.float32, q))
  return pl.pallas_call(
    lambda *refs: _columns_from_rows_kernel(*refs, rows=rows, dtype=dtype, interpret=interpret),
    out_shape=out_shape,
    grid=(blocks, k // B),
    interpret=interpret,
    name="fp8_requantize_columns",
    compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
  )(source, q, scale)


def quantize_rows_and_columns(
  x: jax.Array, source: jax.Array, interpret: bool = False, num_warps: int | None = None, swiglu_of: bool = False
):
  """x [rows, K] (K a multiple of 128) and the row each aligned row holds, source [padded rows] (`rows` for a
  zero row; every row placed: gmm/fp8_blockwise.align_all_rows) ->

    rows_q [rows, K], rows_scale [rows, K/128]         x in 1x128 tiles along K (formats.activation_quantize(x, 1))
    cols_q [padded/128, K, 128], cols_scale [padded/128, K]
                                                       the aligned rows in 128x1 tiles, row-block-major

  The second pair is formats.blockwise_quantize(to_aligned(x, aligned), {0: 128}) with q's row blocks transposed.
  swiglu_of: x is [gate | up] [rows, 2K] and what is quantised is swiglu(gate, up), made tile by tile in
  registers (the bf16 activation is neither written nor read again).
  """
  rows, k = x.shape
  k, swiglu_width = (k // 2, k // 2) if swiglu_of else (k, None)
  num_warps = num_warps or (SWIGLU_WARPS if swiglu_of else ACTIVATION_WARPS)
  blocks = source.shape[0] // B
  out_shape = (
    _out((rows, k), E4M3, x),
    _out((rows, k // B), jnp.float32, x),
    _out((blocks, k, B), E4M3, x),
    _out((blocks, k), jnp.float32, x),
  )
  return pl.pallas_call(
    lambda *refs: _rows_and_columns_kernel(*refs, rows=rows, swiglu_width=swiglu_width, interpret=interpret),
    out_shape=out_shape,
    grid=(blocks, k // B),
    interpret=interpret,
    name="fp8_swiglu_quantize_rows_and_columns" if swiglu_of else "fp8_quantize_rows_and_columns",
    compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),  # one 128x128 tile, no loop to pipeline
  )(source, x)
