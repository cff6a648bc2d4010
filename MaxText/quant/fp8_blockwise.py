"""`quantization: fp8_blockwise`: the expert grouped GEMM with e4m3 operands and DeepSeek-V3 block scales.

  forward  y  = x @ w[g]        x in 1x128 tiles along K, w in 128x128 blocks
  dgrad    dx = dy @ w[g]^T     dy in 1x128 tiles along N, the same weight blocks
  wgrad    dw = x_g^T @ dy_g    x and dy in 128x1 tiles along rows, rows aligned per group to 128
                                so that no tile holds two experts' rows (quant/groups.py)

Gradients pass straight through the quantisers; w stays in its own (master) dtype and is quantised
on the fly each step, once: the backward reads the forward's fp8 weights. Kernels (`moe_gmm_backend`):
`mosaic` runs the Hopper kernels with the scales applied in the kernel (fp8_mosaic.py), and under the
warp-specialized kernel set quantises each tensor into both of its layouts in one pass
(quantize_kernels.py); `xla` runs the same blockwise math in jnp (fp8_reference.py), for CPU and as
the reference.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.moe.gmm import vjp
from MaxText.quant import fp8_mosaic, fp8_reference, quantize_kernels
from MaxText.quant.formats import (
  FP8_BLOCK,
  WEIGHT_BLOCKS,
  Quantized,
  activation_quantize,
  blockwise_quantize,
  dequantize,
  weight_quantize,
)
from MaxText.quant.groups import Aligned, align_groups, to_aligned


def _pad(a: jax.Array, axis: int, multiple: int) -> jax.Array:
  extra = -a.shape[axis] % multiple
  return a if not extra else jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)])


def align_all_rows(group_sizes: jax.Array, rows: int) -> Aligned:
  """Rows aligned per group to 128 for the weight gradient (groups.py). Rows past the groups' total (an
  expert-parallel buffer's tail) form one more group at the end, so that every row has a place (the fused
  quantisation writes every row); the weight gradient reads only the first len(group_sizes) groups."""
  sizes = group_sizes.astype(jnp.int32)
  return align_groups(jnp.append(sizes, rows - jnp.sum(sizes)), rows, FP8_BLOCK)


class QuantizedWeight(NamedTuple):
  """formats.weight_quantize(w) and its values transposed [G, N, K], the forward kernel's K-major operand."""

  q: jax.Array
  scale: jax.Array
  blocks: tuple
  q_t: jax.Array


class MosaicKernels:
  """Lay the quantised operands out as the Hopper kernels need (K-major, widths padded) and call them."""

  # A warpgroup holds the fp32 carry and the per-block partial of 64x128 in registers (2 x 64 per thread):
  # one per CTA, or (warp_specialized) two consumers on 128 x block_n tiles beside a producer warpgroup,
  # 128-column blocks of the carry promoted one at a time (fp8_mosaic._ws_scaled_parts).
  # b_block_scales (warp-specialized): fwd/dgrad take the weights' 128x128 block scales as they are, one
  # per 128 columns and K step, instead of one per column (fp8_mosaic.scaled_ragged_dot_ws).
  # fused_quantize (warp-specialized): weights and activations quantised into both of their layouts in one
  # pass each (quantize_kernels.py), the wgrad operand written row-block-major by it.
  # wgrad: the weight-gradient kernel's own block_n / max_concurrent_steps / overlap_promotion (its
  # per-column scales need registers that a 256-wide tile does not leave: ptxas spills it, 1.8x slower).
  def __init__(
    self,
    block_m: int = 64,
    block_n: int = 128,
    max_concurrent_steps: int = 4,
    grid_block_n: int = 4,
    interpret=False,
    warp_specialized=False,
    b_block_scales=False,
    fused_quantize=False,
    wgrad=None,
  ):
    if b_block_scales and not (warp_specialized and block_n % FP8_BLOCK == 0):
      raise ValueError(f"b_block_scales needs the warp-specialized kernels and block_n a multiple of {FP8_BLOCK}")
    if fused_quantize and not warp_specialized:
      raise ValueError(
        "fused_quantize writes the warp-specialized wgrad kernel's operand layout: it needs warp_specialized"
      )
    if wgrad and not warp_specialized:
      raise ValueError("wgrad tiles apart from the forward's are for the warp-specialized kernels")
    self.block_m, self.block_n, self.interpret = block_m, block_n, interpret
    self.fused_quantize = fused_quantize
    self.pipeline = {"max_concurrent_steps": max_concurrent_steps}
    self.wgrad_options = {"block_n": block_n, **self.pipeline, **(wgrad or {})}
    self.grid_block_n = grid_block_n
    self.row_block_major = warp_specialized  # the wgrad kernel's operand layout: see wgrad
    self.row_kernel_options = {"b_block_scales": True} if b_block_scales else {}
    if warp_specialized:
      self._ragged, self._transposed = fp8_mosaic.scaled_ragged_dot_ws, fp8_mosaic.scaled_transposed_ragged_dot_ws
    else:
      self._ragged, self._transposed = fp8_mosaic.scaled_ragged_dot, fp8_mosaic.scaled_transposed_ragged_dot

  def _rows(self, aq: Quantized, wq_t: jax.Array, ws_t: jax.Array, group_sizes, out_dtype) -> jax.Array:
    """aq [M, K] (1x128 along K), wq_t [G, N, K], ws_t [G, K/128, N/128] -> [M, N]."""
    m, n = aq.q.shape[0], wq_t.shape[1]
    bm, bn = self.block_m, self.block_n
    if (
      n % bn and n % FP8_BLOCK == 0
    ):  # whole weight blocks, not whole tiles (e.g. 1408): 128-wide tiles, no padded weight copy
      bn = FP8_BLOCK
    a = _pad(aq.q, 1, FP8_BLOCK)
    if m < bm:  # the kernel reads whole row tiles: give tiny inputs one
      a = _pad(a, 0, bm)
    sa = _pad(aq.scale.T, 1, bm)  # [K/128, M rounded up]
    b = _pad(_pad(wq_t, 1, bn), 2, FP8_BLOCK)
    if self.row_kernel_options:  # block_n a multiple of 128: each 128 columns of a tile are one weight block
      sb = _pad(ws_t, 2, bn // FP8_BLOCK)
    else:
      sb = _pad(jnp.repeat(ws_t, FP8_BLOCK, axis=2)[:, :, :n], 2, bn)  # each column's weight-block scale
    y = self._ragged(
      a,
      sa,
      b,
      sb,
      group_sizes,
      block_m=bm,
      block_n=bn,
      grid_block_n=self.grid_block_n,
      out_dtype=out_dtype,
      interpret=self.interpret,
      **self.pipeline,
      **self.row_kernel_options,
    )
    return y[:m, :n]

  def weight_quantize(self, w: jax.Array) -> QuantizedWeight:
    if self.fused_quantize and quantize_kernels.supported(*w.shape[1:]):
      wq, q_t = quantize_kernels.weight_quantize_both(w, interpret=bool(self.interpret))
      return QuantizedWeight(*wq, q_t)
    wq = weight_quantize(w)
    return QuantizedWeight(*wq, jnp.swapaxes(wq.q, 1, 2))  # computed only where the forward reads it

  def quantize_both(self, a: jax.Array, aligned: Aligned) -> tuple[Quantized, Quantized]:
    if self.fused_quantize and quantize_kernels.supported(a.shape[1]):
      return quantize_kernels.quantize_rows_and_columns(a, aligned, interpret=bool(self.interpret))
    return quantize_both(a, aligned)

  def swiglu_quantize_both(self, gate: jax.Array, up: jax.Array, aligned: Aligned) -> tuple[Quantized, Quantized]:
    if self.fused_quantize and quantize_kernels.supported(gate.shape[1]):
      # gate and up are the two halves of one GEMM's output: XLA folds the concatenation of adjacent
      # slices back into that output, so the kernel reads it where it is.
      gate_up = jnp.concatenate([gate, up], axis=1)
      return quantize_kernels.quantize_rows_and_columns(
        gate_up, aligned, interpret=bool(self.interpret), swiglu_of=True
      )
    return swiglu_quantize_both(gate, up, aligned)

  def columns_from_rows(self, xq: Quantized, aligned: Aligned, dtype) -> Quantized:
    if self.fused_quantize and quantize_kernels.supported(xq.q.shape[1]):
      return quantize_kernels.columns_from_rows(xq, aligned, dtype, interpret=bool(self.interpret))
    return columns_from_rows(xq, aligned, dtype)

  def fwd(self, xq, wq, group_sizes, out_dtype):
    return self._rows(xq, wq.q_t, wq.scale, group_sizes, out_dtype)

  def dgrad(self, dyq, wq, group_sizes, out_dtype):
    return self._rows(dyq, wq.q, jnp.swapaxes(wq.scale, 1, 2), group_sizes, out_dtype)

  def wgrad(self, xq, dyq, aligned_sizes, out_dtype):
    k, n = xq.scale.shape[1], dyq.scale.shape[1]  # scales [R/128, K] whichever layout the values have
    options = dict(self.wgrad_options)
    bm, bn = self.block_m, options.pop("block_n")
    if self.row_block_major:  # [R/128, K, 128]: each row block transposed on its own, one pass with the quantisation
      a, b = (_pad(rows_block_major(q), 1, block) for q, block in ((xq.q, bm), (dyq.q, bn)))
    else:  # [K, R]
      a, b = _pad(xq.q.T, 0, bm), _pad(dyq.q.T, 0, bn)
    sa, sb = _pad(xq.scale, 1, bm), _pad(dyq.scale, 1, bn)
    dw = self._transposed(
      a, sa, b, sb, aligned_sizes, block_m=bm, block_n=bn, out_dtype=out_dtype, interpret=self.interpret, **options
    )
    return dw[:, :k, :n]


def rows_block_major(q: jax.Array) -> jax.Array:
  """The wgrad operand's values [R, K] (aligned rows) as [R/128, K, 128]; the fused quantisation writes them so."""
  return q if q.ndim == 3 else q.reshape(-1, FP8_BLOCK, q.shape[1]).transpose(0, 2, 1)


def quantize_both(a, aligned):
  """a [rows, K] in 1x128 tiles along K (forward/dgrad operand), and its aligned rows in 128x1 tiles (wgrad)."""
  return activation_quantize(a, 1), columns(a, aligned)


def swiglu_quantize_both(gate, up, aligned):
  """quantize_both of the down GEMM's input swiglu(gate, up)."""
  return quantize_both(quantize_kernels.swiglu(gate, up), aligned)


def columns(a, aligned):
  """a's rows aligned per group, in 128x1 tiles: the wgrad operand."""
  return blockwise_quantize(to_aligned(a, aligned), {0: FP8_BLOCK})


def columns_from_rows(xq: Quantized, aligned: Aligned, dtype) -> Quantized:
  """The wgrad operand from x's rows in 1x128 tiles along K, dequantised to `dtype` first."""
  return columns(dequantize(xq, dtype), aligned)


# The Mosaic kernel variants, by name, as the GPU checks, the lowering test and the benchmarks compare them.
MOSAIC_VARIANTS = {
  "plain": {},
  "ws": {"block_m": 128, "warp_specialized": True},
  "ws_block_scales": {"block_m": 128, "warp_specialized": True, "b_block_scales": True},
  "ws_fused_quantize": {"block_m": 128, "warp_specialized": True, "b_block_scales": True, "fused_quantize": True},
  "ws_wide": {
    "block_m": 128,
    "block_n": 256,
    "max_concurrent_steps": 3,
    "warp_specialized": True,
    "b_block_scales": True,
    "fused_quantize": True,
    "wgrad": {"block_n": 128, "max_concurrent_steps": 4, "overlap_promotion": True},
  },
}
KERNELS = {"xla": fp8_reference, "mosaic": MosaicKernels(**MOSAIC_VARIANTS["plain"])}
# Under a warp-specialized bf16 kernel set (moe_mosaic_kernels: ours_ws). On an H200 (gate_up, G=8) the
# 128x256 fwd/dgrad kernels take 1.60 / 1.55 ms where 128x128 tiles take 1.82 / 1.78 and bf16 2.55 / 2.70;
# the wgrad 2.10 ms (bf16 2.48) (benchmarks/results/2026-12-04-h200-fp8-wide-tiles). The fused
# quantisation passes take 1.05 ms of fwd+bwd where XLA's take 2.2
# (benchmarks/results/2026-12-04-h200-quantize-transposed).
WS_KERNELS = MosaicKernels(**MOSAIC_VARIANTS["ws_wide"])


def make_gmm(kernels):
  """The fp8_blockwise grouped GEMM over `kernels` (an object with fwd, dgrad, wgrad), with its VJP.

  gmm(x, w, group_sizes) quantises x itself; gmm.from_swiglu(gate, up, w, group_sizes) is
  gmm(swiglu(gate, up), w, group_sizes) with the activation made inside the quantisation pass.
  gmm.from_quantized_rows(x, xq, w, group_sizes) takes x's rows already quantised (1x128 along K: row-local,
  so the tokens can be quantised once before the permute and the fp8 rows gathered, moe/layer.py): x's value
  is not read, only its cotangent returned, so the bf16 permute that made it is dead code in the forward. The weight gradient then contracts the dequantised
  fp8 rows, requantised in 128x1 tiles along rows, as DeepSeek-V3 does with its cached fp8 activations."""

  # Kernel sets may quantise in fused passes (MosaicKernels.fused_quantize); the jnp reference does not.
  quantize_w = getattr(kernels, "weight_quantize", weight_quantize)
  quantize_a = getattr(kernels, "quantize_both", quantize_both)
  requantize_columns = getattr(kernels, "columns_from_rows", columns_from_rows)

  def forward(x, w, group_sizes):
    return vjp.typed(kernels.fwd(activation_quantize(x, 1), quantize_w(w), group_sizes, x.dtype), x, w, group_sizes)

  def backward(x_like, x_cols, aligned, w, wq, group_sizes, dy):
    """dx, dw from x's aligned rows in 128x1 tiles and w's quantisation from the forward (w's own values are
    not read again); x_like [0, K] carries x's dtype and shard_map type."""
    dy = dy.astype(x_like.dtype)
    dyq, dy_cols = quantize_a(dy, aligned)
    dx = kernels.dgrad(dyq, wq, group_sizes, x_like.dtype)
    dw = kernels.wgrad(x_cols, dy_cols, aligned.group_sizes[: group_sizes.shape[0]], w.dtype)
    # Typed for shard_map (expert parallelism): see gmm/vjp.py.
    return vjp.typed(dx, dy, w, group_sizes, like=x_like), vjp.typed(dw, x_cols.q, dy, group_sizes, like=w)

  # x is quantised both ways in the forward, and only its fp8 wgrad operand is kept for the backward:
  # half the bytes of x (DeepSeek-V3 keeps its activations in fp8 too). The weight is quantised once, in
  # the forward; the dgrad reads its fp8 values (the layout it needs) from the residuals.
  def gmm_fwd(x, w, group_sizes):
    aligned = align_all_rows(group_sizes, x.shape[0])
    xq, x_cols = quantize_a(x, aligned)
    wq = quantize_w(w)
    y = vjp.typed(kernels.fwd(xq, wq, group_sizes, x.dtype), x, w, group_sizes)
    return y, (x[:0], x_cols, aligned.source, aligned.group_sizes, w, wq.q, wq.scale, group_sizes)

  def gmm_bwd(res, dy):
    x_like, x_cols, source, aligned_sizes, w, wq, w_scale, group_sizes = res
    aligned = Aligned(None, source, aligned_sizes, source.shape[0])  # the map back (dest) is not needed
    dx, dw = backward(x_like, x_cols, aligned, w, Quantized(wq, w_scale, WEIGHT_BLOCKS), group_sizes, dy)
    return dx, dw, jnp.zeros(group_sizes.shape, jax.dtypes.float0)

  gmm = jax.custom_vjp(forward)
  gmm.defvjp(gmm_fwd, gmm_bwd)

  # The down GEMM of swiglu(gate, up), its input quantised in the pass that makes it (quantize_with_activation):
  # the bf16 activation is never written, nor read back by a quantisation pass. The residuals are gate and
  # up, as for gmm(swiglu(gate, up)), so remat's choice for them (moe_mlpwi_0/1) holds.
  quantize_swiglu = getattr(kernels, "swiglu_quantize_both", swiglu_quantize_both)

  def swiglu_forward(gate, up, w, group_sizes):
    return gmm(quantize_kernels.swiglu(gate, up), w, group_sizes)

  def swiglu_fwd(gate, up, w, group_sizes):
    aligned = align_all_rows(group_sizes, gate.shape[0])
    hq, h_cols = quantize_swiglu(gate, up, aligned)
    wq = quantize_w(w)
    y = vjp.typed(kernels.fwd(hq, wq, group_sizes, gate.dtype), gate, up, w, group_sizes)
    return y, (gate, up, h_cols, aligned.source, aligned.group_sizes, w, wq.q, wq.scale, group_sizes)

  def swiglu_bwd(res, dy):
    gate, up, h_cols, source, aligned_sizes, w, wq, w_scale, group_sizes = res
    aligned = Aligned(None, source, aligned_sizes, source.shape[0])
    dh, dw = backward(gate[:0], h_cols, aligned, w, Quantized(wq, w_scale, WEIGHT_BLOCKS), group_sizes, dy)
    dgate, dup = jax.vjp(quantize_kernels.swiglu, gate, up)[1](dh)
    return dgate, dup, dw, jnp.zeros(group_sizes.shape, jax.dtypes.float0)

  from_swiglu = jax.custom_vjp(swiglu_forward)
  from_swiglu.defvjp(swiglu_fwd, swiglu_bwd)
  gmm.from_swiglu = from_swiglu

  rows_blocks = ((1, FP8_BLOCK),)  # activation_quantize(x, 1) of [rows, K]

  def quantized_rows_forward(x, q, scale, w, group_sizes):
    return kernels.fwd(Quantized(q, scale, rows_blocks), quantize_w(w), group_sizes, x.dtype)

  def quantized_rows_fwd(x, q, scale, w, group_sizes):
    wq = quantize_w(w)
    y = kernels.fwd(Quantized(q, scale, rows_blocks), wq, group_sizes, x.dtype)
    return y, (q, scale, w, wq.q, wq.scale, group_sizes)

  def quantized_rows_bwd(res, dy):  # dy has x's dtype (the output's)
    q, scale, w, wq, w_scale, group_sizes = res
    aligned = align_all_rows(group_sizes, q.shape[0])
    x_cols = requantize_columns(Quantized(q, scale, rows_blocks), aligned, dy.dtype)
    x_like = jnp.zeros((0, q.shape[1]), dy.dtype)  # x's dtype (dy's) and, through vjp.typed's inputs, its type
    dx, dw = backward(vjp.typed(x_like, q), x_cols, aligned, w, Quantized(wq, w_scale, WEIGHT_BLOCKS), group_sizes, dy)
    # The quantised rows come from stop_gradient'ed tokens: nothing flows back through them.
    return dx, jnp.zeros_like(q), jnp.zeros_like(scale), dw, jnp.zeros(group_sizes.shape, jax.dtypes.float0)

  from_rows = jax.custom_vjp(quantized_rows_forward)
  from_rows.defvjp(quantized_rows_fwd, quantized_rows_bwd)
  gmm.from_quantized_rows = lambda x, xq, w, group_sizes: from_rows(x, xq.q, xq.scale, w, group_sizes)
  gmm.quantize_rows = lambda x: activation_quantize(jax.lax.stop_gradient(x), 1)
  return gmm
