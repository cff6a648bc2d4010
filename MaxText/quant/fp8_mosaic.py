"""FP8 blockwise grouped GEMMs for Hopper (sm_90) in Pallas Mosaic GPU: e4m3 operands, fp32 accumulation,
per-block scales applied inside the kernel (the DeepGEMM scheme of DeepSeek-V3, section 3.3).

  scaled_ragged_dot             y[r] = sum_kb sa[kb, r] * sb[g, kb, :] * (a[r, kb] @ b[g, :, kb]^T)
                                forward (a = x, b = w^T) and dgrad (a = dy, b = w)
  scaled_transposed_ragged_dot  dw[g] = sum_j sa[j, :]^T * sb[j, :] * (a[:, j] @ b[:, j]^T) over the
                                128-row blocks j of group g (rows aligned per group: quant/groups.py)

Hopper's fp8 wgmma takes both operands K-major (contraction axis contiguous), so b is [G, N, K] for
the forward (a transposed copy of the quantised weight; 128x128 weight blocks read the same both
ways) and x, dy are transposed for the weight gradient. Each 128-wide K step runs one wgmma into a
fresh accumulator, then adds partial * row scale * column scale into the fp32 carry: fp8 products
accumulate in the tensor core at limited precision, so promoting every 128 elements into fp32 is
what keeps the error at bf16 level (DeepSeek-V3, "increasing accumulation precision").
Row-group handling follows JAX's ragged_dot_mgpu (its GroupInfo is reused): a row block spanning two
groups is computed once per group and each pass stores only its own rows.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

BLOCK_K = 128  # = the scale block: one wgmma K step per scale
NUM_SMS = 132  # H100/H200 SXM


def _num_sms() -> int:
  device = jax.devices()[0]
  return getattr(device, "core_count", NUM_SMS) if device.platform == "gpu" else NUM_SMS


def _scaled_step(plgpu, pl, a_smem, sa_smem, b_smem, sb_smem, acc):
  """acc + (a @ b^T) * sa[:, None] * sb[None, :] for one 128-wide K block."""
  m, n = a_smem.shape[0], b_smem.shape[0]

  def product(part_ref):
    plgpu.wgmma(part_ref, a_smem, b_smem.transpose((1, 0)))
    return part_ref[...]

  part = pl.run_scoped(product, plgpu.ACC((m, n), jnp.float32))
  sa = plgpu.load(sa_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
  sb = plgpu.load(sb_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
  return acc + part * lax.broadcast_in_dim(sa, (m, n), [0]) * lax.broadcast_in_dim(sb, (m, n), [1])


def _zeros(plgpu, m, n):
  return plgpu.layout_cast(jnp.full((m, n), 0.0, jnp.float32), plgpu.Layout.WGMMA)


def scaled_ragged_dot(a, a_scale, b, b_scale, group_sizes, *, block_m=64, block_n=128, max_concurrent_steps=4, grid_block_n=4, out_dtype=jnp.bfloat16, interpret=False):
  """a [M, K] e4m3, a_scale [K/128, M'] f32 (M' >= M rounded up to block_m), b [G, N, K] e4m3,
  b_scale [G, K/128, N] f32 -> [M, N] out_dtype. K a multiple of 128, N of block_n."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import GroupInfo

  m, k = a.shape
  g, n, k2 = b.shape
  if k != k2 or k % BLOCK_K or n % block_n:
    raise ValueError(f"scaled_ragged_dot: a {a.shape}, b {b.shape}: K must match and be a multiple of {BLOCK_K}, N of {block_n}")
  if a_scale.shape[1] < pl.cdiv(m, block_m) * block_m:
    raise ValueError(f"a_scale {a_scale.shape} must cover {pl.cdiv(m, block_m) * block_m} rows")

  def body(sizes_gmem, a_gmem, sa_gmem, b_gmem, sb_gmem, o_gmem):
    grid_m = pl.cdiv(m, block_m) + g - 1
    grid_n = n // block_n

    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def tile(loop_info):
      mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, grid_block_n)
      group = GroupInfo.create(sizes_gmem, block_m, mi)
      acc = plgpu.emit_pipeline(
          lambda _, a_s, sa_s, b_s, sb_s, acc: _scaled_step(plgpu, pl, a_s, sa_s, b_s, sb_s, acc),
          grid=(k // BLOCK_K,),
          in_specs=[
              plgpu.BlockSpec((block_m, BLOCK_K), lambda kb: (group.block, kb)),
              plgpu.BlockSpec((1, block_m), lambda kb: (kb, group.block)),
              plgpu.BlockSpec((block_n, BLOCK_K), lambda kb: (ni, kb)),
              plgpu.BlockSpec((1, block_n), lambda kb: (kb, ni)),
          ],
          max_concurrent_steps=max_concurrent_steps,
          init_carry=_zeros(plgpu, block_m, block_n),
      )(a_gmem, sa_gmem, b_gmem.at[group.group_id], sb_gmem.at[group.group_id])
      _store_group_rows(plgpu, pl, acc, o_gmem, group, ni, block_m, block_n, m)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(_num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret,
  )
  return kernel(group_sizes.astype(jnp.int32), a, a_scale, b, b_scale)


def _store_group_rows(plgpu, pl, acc, o_gmem, group, ni, block_m, block_n, m):
  """Write this group's rows of the tile: TMA stores have static shapes, so the dynamic row count is
  written as a sum of powers of two (one store per set bit of the count)."""

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), o_gmem.dtype))
  def _(o_smem):
    o_smem[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    offset = group.start_within_block
    size = 1 << int(math.log2(min(block_m, m)))
    while size >= 1:
      @pl.when(group.actual_size & size != 0)
      def _():
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, size)], o_gmem.at[pl.ds(group.block_start + offset, size), pl.ds(ni * block_n, block_n)])

      offset = offset + (group.actual_size & size)
      size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def scaled_transposed_ragged_dot(a, a_scale, b, b_scale, group_sizes, *, block_m=64, block_n=128, max_concurrent_steps=4, grid_block_n=1, out_dtype=jnp.bfloat16, interpret=False):
  """a [K, R] e4m3 (x^T), a_scale [R/128, K] f32, b [N, R] e4m3 (dy^T), b_scale [R/128, N] f32,
  group_sizes [G] all multiples of 128 -> [G, K, N] out_dtype. K a multiple of block_m, N of block_n."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  k, rows = a.shape
  n, rows2 = b.shape
  g = group_sizes.shape[0]
  if rows != rows2 or rows % BLOCK_K or k % block_m or n % block_n:
    raise ValueError(f"scaled_transposed_ragged_dot: a {a.shape}, b {b.shape}: rows must match and be a multiple of {BLOCK_K}; K of {block_m}, N of {block_n}")
  sizes = group_sizes.astype(jnp.int32)
  starts = jnp.cumsum(sizes) - sizes
  row_blocks = rows // BLOCK_K

  def body(sizes_gmem, starts_gmem, a_gmem, sa_gmem, b_gmem, sb_gmem, o_gmem):
    grid_k, grid_n = k // block_m, n // block_n

    @plgpu.nd_loop((g, grid_k * grid_n), collective_axes="sm")
    def tile(loop_info):
      gi = loop_info.index[0]
      ki, ni = plgpu.planar_snake(loop_info.index[1], (grid_k, grid_n), 1, grid_block_n)
      num_blocks = sizes_gmem[gi] // BLOCK_K
      first = pl.multiple_of(starts_gmem[gi], BLOCK_K)
      first_block = first // BLOCK_K

      def store(acc):
        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), o_gmem.dtype))
        def _(o_smem):
          o_smem[...] = acc.astype(o_smem.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[gi, pl.ds(ki * block_m, block_m), pl.ds(ni * block_n, block_n)])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      @pl.when(num_blocks > 0)
      def _():
        # The slices run past the end for later groups; the pipeline only reads num_blocks blocks.
        acc = plgpu.emit_pipeline(
            lambda _, a_s, sa_s, b_s, sb_s, acc: _scaled_step(plgpu, pl, a_s, sa_s, b_s, sb_s, acc),
            grid=(num_blocks,),
            in_specs=[
                plgpu.BlockSpec((block_m, BLOCK_K), lambda j: (ki, j)),
                plgpu.BlockSpec((1, block_m), lambda j: (j, ki)),
                plgpu.BlockSpec((block_n, BLOCK_K), lambda j: (ni, j)),
                plgpu.BlockSpec((1, block_n), lambda j: (j, ni)),
            ],
            max_concurrent_steps=max_concurrent_steps,
            init_carry=_zeros(plgpu, block_m, block_n),
        )(a_gmem.at[:, pl.ds(first, rows)], sa_gmem.at[pl.ds(first_block, row_blocks)], b_gmem.at[:, pl.ds(first, rows)], sb_gmem.at[pl.ds(first_block, row_blocks)])
        store(acc)

      @pl.when(num_blocks == 0)
      def _():
        store(_zeros(plgpu, block_m, block_n))

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      grid=(_num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret,
  )
  return kernel(sizes, starts, a, a_scale, b, b_scale)
