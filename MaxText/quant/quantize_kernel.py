"""fp8_blockwise's activation quantisation in one pass over the activation (a Pallas Triton kernel).

An fp8 expert GEMM quantises each of its activations (x in the forward, dy in the backward) twice:
in 1x128 tiles along K for the forward/dgrad GEMM, and in 128x1 tiles along rows for the weight
gradient, with rows aligned per group (groups.py) and stored row-block-major [padded_rows/128, K, 128],
the layout the wgrad kernel reads. Written in jnp (formats.py), XLA runs that as four passes over the
activation: an amax reduction and a quantise for each tiling. This kernel reads each 128x128 tile of
the aligned layout once (its rows gathered by the alignment's source index) and writes both.

Numerics are formats.blockwise_quantize's, bit for bit: scale amax * fp32(1/448) (1 for an all-zero
tile, NaN for one holding Inf/NaN), an IEEE division, clamping to +-448, rounding to nearest even.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from MaxText.quant.formats import E4M3, E4M3_MAX, FP8_BLOCK, Quantized
from MaxText.moe.gmm import vjp
from MaxText.quant.groups import Aligned

F32_MAX = float(np.finfo(np.float32).max)
ROWS_BLOCKS = ((1, FP8_BLOCK),)  # the 1x128 tiling along K of x [rows, K]
COLUMNS_BLOCKS = ((0, FP8_BLOCK),)  # the 128x1 tiling along rows


def supported(shape: tuple[int, ...]) -> bool:
  return len(shape) == 2 and shape[1] % FP8_BLOCK == 0


def _divide(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
  if interpret:
    return a / b
  # Triton's f32 division is the approximate div.full.f32; the format (and XLA) divide exactly.
  return plt.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                    result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _quantize_tile(x: jax.Array, axis: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """x [128, 128] f32 in 128-element blocks along `axis` -> (e4m3 values, f32 scales [128])."""
  magnitude = jnp.abs(x)
  amax = jnp.max(magnitude, axis=axis)
  # Inf and NaN explicitly: whether a max reduction keeps a NaN is the backend's choice.
  bad = jnp.max(jnp.where(magnitude <= F32_MAX, 0.0, 1.0), axis=axis) > 0
  scale = jnp.where(amax == 0, 1.0, amax * jnp.float32(1.0 / E4M3_MAX))
  scale = jnp.where(bad, jnp.nan, scale)
  expand = (lambda v: v[None, :]) if axis == 0 else (lambda v: v[:, None])
  value = jnp.clip(_divide(x, jnp.broadcast_to(expand(scale), x.shape), interpret), -E4M3_MAX, E4M3_MAX)
  value = jnp.where(expand(bad), jnp.nan, value)  # a clamp by min/max may have dropped the NaN
  return value.astype(E4M3), scale


def _kernel(source_ref, x_ref, rows_q_ref, rows_s_ref, cols_q_ref, cols_s_ref, *, rows: int, interpret: bool):
  block, j = pl.program_id(0), pl.program_id(1)
  source = source_ref[pl.ds(block * FP8_BLOCK, FP8_BLOCK)]  # the rows of x this aligned row block holds
  valid = source < rows  # the others (index `rows`) are the alignment's zero rows: masked, never touched
  columns = pl.ds(j * FP8_BLOCK, FP8_BLOCK)
  tile = (source[:, None], j * FP8_BLOCK + jnp.arange(FP8_BLOCK, dtype=jnp.int32)[None, :])  # gathered rows x columns
  x = plt.load(x_ref.at[tile], mask=valid[:, None], other=0).astype(jnp.float32)
  q, scale = _quantize_tile(x, 0, interpret)
  cols_q_ref[block, columns, :] = q.T
  cols_s_ref[block, columns] = scale
  q, scale = _quantize_tile(x, 1, interpret)
  plt.store(rows_q_ref.at[tile], q, mask=valid[:, None])
  plt.store(rows_s_ref.at[source, j], scale, mask=valid)


def quantize_rows_and_columns(x: jax.Array, aligned: Aligned, interpret: bool = False) -> tuple[Quantized, Quantized]:
  """x [rows, K] (K a multiple of 128) and its alignment (every row placed: fp8_blockwise.align_all_rows) ->

    (x in 1x128 tiles along K: q [rows, K], scale [rows, K/128]   as formats.activation_quantize(x, 1),
     the aligned rows in 128x1 tiles: q [padded/128, K, 128] (row-block-major), scale [padded/128, K])

  The second is blockwise_quantize(to_aligned(x, aligned), {0: 128}) with q's row blocks transposed.
  """
  rows, k = x.shape
  blocks = aligned.padded_rows // FP8_BLOCK
  out_shape = (
      jax.ShapeDtypeStruct((rows, k), E4M3),
      jax.ShapeDtypeStruct((rows, k // FP8_BLOCK), jnp.float32),
      jax.ShapeDtypeStruct((blocks, k, FP8_BLOCK), E4M3),
      jax.ShapeDtypeStruct((blocks, k), jnp.float32),
  )
  kernel = pl.pallas_call(
      lambda *refs: _kernel(*refs, rows=rows, interpret=interpret),
      out_shape=out_shape,
      grid=(blocks, k // FP8_BLOCK),
      interpret=interpret,
      name="fp8_quantize_rows_and_columns",
      compiler_params=plt.CompilerParams(num_warps=8, num_stages=1),  # one 128x128 tile, no loop to pipeline
  )
  # Typed as x for shard_map (expert parallelism): a Pallas kernel's outputs carry no varying axes.
  rows_q, rows_s, cols_q, cols_s = (vjp.typed(a, x, aligned.source) for a in kernel(aligned.source, x))
  return Quantized(rows_q, rows_s, ROWS_BLOCKS), Quantized(cols_q, cols_s, COLUMNS_BLOCKS)
