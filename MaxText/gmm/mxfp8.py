"""`quantization: mxfp8`: the expert grouped GEMM on MXFP8 operands (e4m3, one e8m0 scale per 32).

  forward  y  = x @ w[g]        x and w in blocks of 32 along K
  dgrad    dx = dy @ w[g]^T     dy and w in blocks of 32 along N
  wgrad    dw = x_g^T @ dy_g    x and dy in blocks of 32 along rows, rows aligned per group to 32
                                so that no block holds two experts' rows (quant/groups.py)

This is `mxfp8_impl: emulated`, what runs where the tensor cores have no block-scaled MMA (Hopper):
each operand is quantised, dequantised into the compute dtype (exact: e4m3 times a power of two fits
bf16) and multiplied by the chosen bf16 grouped-GEMM backend (`moe_gmm_backend`). Gradients pass
straight through the quantisers; master weights keep their dtype. Blackwell's path, block-scaled
products on the e4m3 values and e8m0 scales themselves, is mxfp8_block_scaled.py.
"""

import jax

from MaxText.gmm.base import FunctionGemm
from MaxText.gmm.vjp import grouped_gemm_with_vjp
from MaxText.quant.formats import MX_BLOCK, fake_quantize, mx_quantize
from MaxText.quant.groups import align_groups, from_aligned, to_aligned


def _rows_quantized(a: jax.Array, aligned) -> jax.Array:
  """a [rows, ...] through MXFP8 with blocks of 32 rows inside each group."""
  return from_aligned(fake_quantize(to_aligned(a, aligned), mx_quantize, 0), aligned)


def make_gmm(fwd, dgrad, wgrad):
  """The MXFP8 grouped GEMM over a bf16 backend's three kernels, with its VJP (gmm/vjp.py's rule, which
  also types the results for shard_map)."""

  def quantized_fwd(x, w, group_sizes):
    return fwd(fake_quantize(x, mx_quantize, 1), fake_quantize(w, mx_quantize, 1), group_sizes)

  def quantized_dgrad(dy, w, group_sizes):
    return dgrad(fake_quantize(dy, mx_quantize, 1), fake_quantize(w, mx_quantize, 2), group_sizes)

  def quantized_wgrad(x, dy, group_sizes):
    aligned = align_groups(group_sizes, x.shape[0], MX_BLOCK)
    return wgrad(_rows_quantized(x, aligned), _rows_quantized(dy, aligned), group_sizes)

  return grouped_gemm_with_vjp(quantized_fwd, quantized_dgrad, quantized_wgrad)


def build(entry, options) -> FunctionGemm:
  from MaxText import gmm

  return FunctionGemm(entry.name, make_gmm(*gmm.build(entry.backend).kernels))
