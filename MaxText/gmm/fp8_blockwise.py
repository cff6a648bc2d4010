"""`quantization: fp8_blockwise`: the expert grouped GEMM with e4m3 operands and DeepSeek-V3 block scales.

  forward  y  = x @ w[g]        x in 1x128 tiles along K, w in 128x128 blocks
  dgrad    dx = dy @ w[g]^T     dy in 1x128 tiles along N, the same weight blocks
  wgrad    dw = x_g^T @ dy_g    x and dy in 128x1 tiles along rows, rows aligned per group to 128
                                so that no tile holds two experts' rows (quant/groups.py)

Gradients pass straight through the quantisers; w stays in its own (master) dtype and is quantised on the
fly each step, once: the backward reads the forward's fp8 weights. Two kernel sets behind one interface
(fwd, dgrad, wgrad and the quantisation passes): `MosaicKernels` lays the operands out for the Hopper
kernels (kernels/mosaic_fp8_gmm.py) and quantises each tensor into both of its layouts in one pass
(kernels/triton_quantize.py); `ReferenceKernels` runs the same blockwise math in jnp (fp8_reference.py),
for CPU and as the reference.

The GEMM also has the two fused entry points of base.ExpertGemm: `swiglu_down` makes the down GEMM's input
silu(gate) * up inside its quantisation pass (quantize_with_activation), and `quantize_rows` /
`from_quantized_rows` take the gate/up GEMM's rows quantised once per token before the permute
(quantize_before_permute).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.gmm import fp8_reference, vjp
from MaxText.gmm.base import ExpertGemm
from MaxText.kernels import mosaic_fp8_gmm, triton_quantize
from MaxText.kernels.padding import pad_to
from MaxText.kernels.triton_quantize import swiglu
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

ROWS_BLOCKS = ((1, FP8_BLOCK),)  # activation_quantize(x, 1) of x [rows, K]: 1x128 tiles along K
COLUMNS_BLOCKS = ((0, FP8_BLOCK),)  # 128x1 tiles along rows


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


def quantize_both(a, aligned):
  """a [rows, K] in 1x128 tiles along K (forward/dgrad operand), and its aligned rows in 128x1 tiles (wgrad)."""
  return activation_quantize(a, 1), columns(a, aligned)


def columns(a, aligned):
  """a's rows aligned per group, in 128x1 tiles: the wgrad operand."""
  return blockwise_quantize(to_aligned(a, aligned), {0: FP8_BLOCK})


def columns_from_rows(xq: Quantized, aligned: Aligned, dtype) -> Quantized:
  """The wgrad operand from x's rows in 1x128 tiles along K, dequantised to `dtype` first."""
  return columns(dequantize(xq, dtype), aligned)


class ReferenceKernels:
  """The kernels in jnp (fp8_reference.py) and the format's own quantisers: CPU runs and the reference."""

  fwd, dgrad, wgrad = (
    staticmethod(fp8_reference.fwd),
    staticmethod(fp8_reference.dgrad),
    staticmethod(fp8_reference.wgrad),
  )

  def weight_quantize(self, w):
    return weight_quantize(w)

  def quantize_both(self, a, aligned):
    return quantize_both(a, aligned)

  def swiglu_quantize_both(self, gate, up, aligned):
    return quantize_both(swiglu(gate, up), aligned)

  def columns_from_rows(self, xq, aligned, dtype):
    return columns_from_rows(xq, aligned, dtype)


def rows_block_major(q: jax.Array) -> jax.Array:
  """The wgrad operand's values [R, K] (aligned rows) as [R/128, K, 128]; the fused quantisation writes them so."""
  return q if q.ndim == 3 else q.reshape(-1, FP8_BLOCK, q.shape[1]).transpose(0, 2, 1)


class MosaicKernels:
  """Lay the quantised operands out as the Hopper kernels need (K-major, widths padded) and call them.

  Forward and dgrad run 128x256 tiles (block_n: two consumer warpgroups of 64 rows each hold a 64x256 fp32
  carry, promoted 128 columns at a time); the weight gradient, whose scales are per column, 128x128 tiles
  with each promotion overlapped with the next K step's MMA (a 256-wide wgrad tile spills: 1.8x slower).
  On an H200 (gate_up, G=8) forward/dgrad take 1.60 / 1.55 ms (bf16 2.55 / 2.70), the wgrad 2.10 (bf16
  2.48) (benchmarks/results/2026-12-04-h200-fp8-wide-tiles). Each tensor is quantised into both of its
  layouts in one Triton pass where its widths are whole 128-blocks (1.05 ms of fwd+bwd where XLA's passes
  take 2.2: benchmarks/results/2026-12-04-h200-quantize-transposed), in jnp otherwise. The constructor's
  arguments are the tile options benchmarks sweep; the defaults are what training runs.
  """

  def __init__(self, block_n=256, max_concurrent_steps=3, grid_block_n=4, wgrad=None, interpret=False):
    self.block_m, self.block_n, self.grid_block_n, self.interpret = 128, block_n, grid_block_n, interpret
    self.pipeline = {"max_concurrent_steps": max_concurrent_steps}
    self.wgrad_options = {"block_n": 128, "max_concurrent_steps": 4, "overlap_promotion": True, **(wgrad or {})}

  def _rows(self, aq: Quantized, wq_t: jax.Array, ws_t: jax.Array, group_sizes, out_dtype) -> jax.Array:
    """aq [M, K] (1x128 along K), wq_t [G, N, K], ws_t [G, K/128, N/128] -> [M, N]."""
    m, n = aq.q.shape[0], wq_t.shape[1]
    bm, bn = self.block_m, self.block_n
    if n % bn and n % FP8_BLOCK == 0:  # whole weight blocks, not whole tiles (e.g. 1408): 128-wide tiles
      bn = FP8_BLOCK
    a = pad_to(aq.q, 1, FP8_BLOCK)
    if m < bm:  # the kernel reads whole row tiles: give tiny inputs one
      a = pad_to(a, 0, bm)
    sa = pad_to(aq.scale.T, 1, bm)  # [K/128, M rounded up]
    b = pad_to(pad_to(wq_t, 1, bn), 2, FP8_BLOCK)
    sb = pad_to(ws_t, 2, bn // FP8_BLOCK)  # each 128 columns of a tile are one weight block
    y = mosaic_fp8_gmm.scaled_ragged_dot(
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
    )
    return y[:m, :n]

  def weight_quantize(self, w: jax.Array) -> QuantizedWeight:
    if triton_quantize.supported(*w.shape[1:]):
      q, scale, q_t = triton_quantize.weight_quantize_both(w, interpret=bool(self.interpret))
      return QuantizedWeight(q, scale, WEIGHT_BLOCKS, q_t)
    wq = weight_quantize(w)
    return QuantizedWeight(*wq, jnp.swapaxes(wq.q, 1, 2))  # computed only where the forward reads it

  def _rows_and_columns(self, x, aligned, swiglu_of=False) -> tuple[Quantized, Quantized]:
    out = triton_quantize.quantize_rows_and_columns(x, aligned.source, bool(self.interpret), swiglu_of=swiglu_of)
    rows_q, rows_s, cols_q, cols_s = (vjp.typed(a, aligned.source) for a in out)  # and as the alignment
    return Quantized(rows_q, rows_s, ROWS_BLOCKS), Quantized(cols_q, cols_s, COLUMNS_BLOCKS)

  def quantize_both(self, a: jax.Array, aligned: Aligned) -> tuple[Quantized, Quantized]:
    if triton_quantize.supported(a.shape[1]):
      return self._rows_and_columns(a, aligned)
    return quantize_both(a, aligned)

  def swiglu_quantize_both(self, gate: jax.Array, up: jax.Array, aligned: Aligned) -> tuple[Quantized, Quantized]:
    if triton_quantize.supported(gate.shape[1]):
      # gate and up are the two halves of one GEMM's output: XLA folds the concatenation of adjacent
      # slices back into that output, so the kernel reads it where it is.
      return self._rows_and_columns(jnp.concatenate([gate, up], axis=1), aligned, swiglu_of=True)
    return quantize_both(swiglu(gate, up), aligned)

  def columns_from_rows(self, xq: Quantized, aligned: Aligned, dtype) -> Quantized:
    if triton_quantize.supported(xq.q.shape[1]):
      out = triton_quantize.columns_from_rows(xq.q, xq.scale, aligned.source, dtype, interpret=bool(self.interpret))
      cols_q, cols_s = (vjp.typed(a, aligned.source) for a in out)
      return Quantized(cols_q, cols_s, COLUMNS_BLOCKS)
    return columns_from_rows(xq, aligned, dtype)

  def fwd(self, xq, wq, group_sizes, out_dtype):
    return self._rows(xq, wq.q_t, wq.scale, group_sizes, out_dtype)

  def dgrad(self, dyq, wq, group_sizes, out_dtype):
    return self._rows(dyq, wq.q, jnp.swapaxes(wq.scale, 1, 2), group_sizes, out_dtype)

  def wgrad(self, xq, dyq, aligned_sizes, out_dtype):
    k, n = xq.scale.shape[1], dyq.scale.shape[1]  # scales [R/128, K] whichever layout the values have
    options = dict(self.wgrad_options)
    bm, bn = self.block_m, options.pop("block_n")
    # [R/128, K, 128]: each row block transposed on its own, in one pass with the quantisation
    a, b = (pad_to(rows_block_major(q), 1, block) for q, block in ((xq.q, bm), (dyq.q, bn)))
    sa, sb = pad_to(xq.scale, 1, bm), pad_to(dyq.scale, 1, bn)
    dw = mosaic_fp8_gmm.scaled_ragged_wgrad(
      a, sa, b, sb, aligned_sizes, block_m=bm, block_n=bn, out_dtype=out_dtype, interpret=self.interpret, **options
    )
    return dw[:, :k, :n]


def _grouped_gemms(kernels):
  """The fp8_blockwise GEMM over `kernels` (MosaicKernels or ReferenceKernels), with its VJP, and its two
  fused forms: (gmm(x, w, sizes), from_swiglu(gate, up, w, sizes), from_rows(x, q, scale, w, sizes)).

  from_rows takes x's rows already quantised (1x128 along K: row-local, so the tokens can be quantised once
  before the permute and the fp8 rows gathered, moe/layer.py): x's value is not read, only its cotangent
  returned, so the bf16 permute that made it is dead code in the forward. The weight gradient then contracts
  the dequantised fp8 rows, requantised in 128x1 tiles along rows, as DeepSeek-V3 does with its cached fp8
  activations."""

  quantize_w, quantize_a, requantize_columns = kernels.weight_quantize, kernels.quantize_both, kernels.columns_from_rows

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
  quantize_swiglu = kernels.swiglu_quantize_both

  def swiglu_forward(gate, up, w, group_sizes):
    return gmm(swiglu(gate, up), w, group_sizes)

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
    dgate, dup = jax.vjp(swiglu, gate, up)[1](dh)
    return dgate, dup, dw, jnp.zeros(group_sizes.shape, jax.dtypes.float0)

  from_swiglu = jax.custom_vjp(swiglu_forward)
  from_swiglu.defvjp(swiglu_fwd, swiglu_bwd)
  rows_blocks = ROWS_BLOCKS

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
  return gmm, from_swiglu, from_rows


class Fp8BlockwiseGemm(ExpertGemm):
  """The expert GEMM of fp8_blockwise:mosaic / fp8_blockwise:xla, with the fusions the options turn on."""

  def __init__(self, name: str, kernels, fuse_activation: bool = True, quantize_before_permute: bool = True):
    self.name, self.kernels = name, kernels
    self._gmm, self._from_swiglu, self._from_rows = _grouped_gemms(kernels)
    self.fuses = ("swiglu_down",) * fuse_activation + ("quantized_rows",) * quantize_before_permute

  def __call__(self, x, w, group_sizes):
    return self._gmm(x, w, group_sizes)

  def swiglu_down(self, gate, up, w, group_sizes):
    if "swiglu_down" in self.fuses:
      return self._from_swiglu(gate, up, w, group_sizes)
    return super().swiglu_down(gate, up, w, group_sizes)

  def quantize_rows(self, tokens):
    if "quantized_rows" in self.fuses:
      return activation_quantize(jax.lax.stop_gradient(tokens), 1)
    return None

  def from_quantized_rows(self, x, xq, w, group_sizes):
    return self._from_rows(x, xq.q, xq.scale, w, group_sizes)


def build(entry, options) -> Fp8BlockwiseGemm:
  kernels = MosaicKernels(interpret=options.interpret) if entry.backend == "mosaic" else ReferenceKernels()
  return Fp8BlockwiseGemm(entry.name, kernels, options.fuse_activation, options.quantize_before_permute)
