"""The fp8_blockwise grouped GEMMs in jnp: the same blockwise math as the Mosaic kernels (kernels/mosaic_fp8_gmm.py),
for CPU runs and as their reference.

Each 128-wide block of the contraction is multiplied exactly (e4m3 products are exact in fp32 and
these sums are accumulated in fp32), then scaled by its row and column scales and added into an fp32
accumulator, block after block, as the kernel does.
"""

import jax
import jax.numpy as jnp

from MaxText.quant.formats import FP8_BLOCK, Quantized
from MaxText.quant.groups import row_groups


def _blocks(k: int) -> list[slice]:
  return [slice(s, min(s + FP8_BLOCK, k)) for s in range(0, k, FP8_BLOCK)]


def _scaled_ragged(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """a [M, K] e4m3, sa [M, K/128], b [G, K, N] e4m3, sb [G, K/128, N/128] -> [M, N] float32."""
  m, k = a.shape
  n = b.shape[2]
  sb_rows = jnp.repeat(sb[row_groups(group_sizes, m)], FP8_BLOCK, axis=2)[:, :, :n]  # [M, K/128, N]
  acc = jnp.zeros((m, n), jnp.float32)
  for kb, cols in enumerate(_blocks(k)):
    part = jax.lax.ragged_dot(
      a[:, cols].astype(jnp.float32), b[:, cols].astype(jnp.float32), group_sizes, preferred_element_type=jnp.float32
    )
    acc = acc + part * sa[:, kb, None] * sb_rows[:, kb]
  return acc


def fwd(xq: Quantized, wq: Quantized, group_sizes: jax.Array, out_dtype) -> jax.Array:
  """y = x @ w[g]: x in 1x128 tiles along K, w in 128x128 blocks."""
  return _scaled_ragged(xq.q, xq.scale, wq.q, wq.scale, group_sizes).astype(out_dtype)


def dgrad(dyq: Quantized, wq: Quantized, group_sizes: jax.Array, out_dtype) -> jax.Array:
  """dx = dy @ w[g]^T: dy in 1x128 tiles along N; the same 128x128 weight blocks, transposed."""
  return _scaled_ragged(dyq.q, dyq.scale, jnp.swapaxes(wq.q, 1, 2), jnp.swapaxes(wq.scale, 1, 2), group_sizes).astype(
    out_dtype
  )


def wgrad(xq: Quantized, dyq: Quantized, aligned_sizes: jax.Array, out_dtype) -> jax.Array:
  """dw[g] = x_g^T @ dy_g over rows aligned per group (quant/groups.py), in 128x1 tiles along rows."""
  rows, k = xq.q.shape
  n = dyq.q.shape[1]
  nb = rows // FP8_BLOCK
  xb = xq.q.astype(jnp.float32).reshape(nb, FP8_BLOCK, k)
  dyb = dyq.q.astype(jnp.float32).reshape(nb, FP8_BLOCK, n)
  part = jnp.einsum("jrk,jrn->jkn", xb, dyb, preferred_element_type=jnp.float32)
  part = part * xq.scale[:, :, None] * dyq.scale[:, None, :]
  block_group = jnp.searchsorted(jnp.cumsum(aligned_sizes // FP8_BLOCK), jnp.arange(nb), side="right")
  return jax.ops.segment_sum(part, block_group, num_segments=aligned_sizes.shape[0]).astype(out_dtype)
