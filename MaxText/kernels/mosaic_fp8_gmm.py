"""FP8 blockwise grouped GEMMs for Hopper (sm_90) in Pallas Mosaic GPU: e4m3 operands, fp32 accumulation,
per-block scales applied inside the kernel (the DeepGEMM scheme of DeepSeek-V3, section 3.3).

  scaled_ragged_dot    y[r] = sum_kb sa[kb, r] * sb[g, kb, nb] * (a[r, kb] @ b[g, :, kb]^T)
                       forward (a = x, b = w^T) and dgrad (a = dy, b = w); sb the weights' 128x128 block scales
  scaled_ragged_wgrad  dw[g] = sum_j sa[j, :]^T * sb[j, :] * (a[:, j] @ b[:, j]^T) over the 128-row blocks j
                       of group g (rows aligned per group: quant/groups.py)

Hopper's fp8 wgmma takes both operands K-major (contraction axis contiguous), so b is [G, N, K] for the
forward (a transposed copy of the quantised weight; 128x128 weight blocks read the same both ways) and x,
dy are row-block-major for the weight gradient. Each 128-wide K step runs one wgmma into a fresh
accumulator, then adds partial * row scale * column scale into the fp32 carry: fp8 products accumulate in
the tensor core at limited precision, so promoting every 128 elements into fp32 is what keeps the error at
bf16 level (DeepSeek-V3, "increasing accumulation precision").

Both kernels run on the warp-specialized pipeline (mosaic_pipeline.py): a producer warpgroup keeps K steps
in flight across output tiles and two consumer warpgroups promote their halves of a 128-row tile, so one's
wgmma runs while the other scales and accumulates. The forward and dgrad kernels take one weight scale per
128 columns and K step and run 128x256 tiles: ~1,200-1,240 TFLOP/s on an H200, 1.6-1.7x the bf16 kernels
(128x128 tiles reached ~1,050, bound by operand bytes per product). The weight gradient, whose scales are
per column, keeps 128x128 tiles: ~920 TFLOP/s, 1.18x bf16 (benchmarks/results/2026-12-04-h200-fp8-wide-tiles;
the single-warpgroup kernels these replaced are measured in benchmarks/results/2026-12-03-h200-fp8-block-scales).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from MaxText.kernels.mosaic_pipeline import store_rows, tile_schedule, warp_specialized, ws_kernel

BLOCK_K = 128  # = the scale block: one wgmma K step per scale


def _zeros(plgpu, m, n):
  return plgpu.layout_cast(jnp.full((m, n), 0.0, jnp.float32), plgpu.Layout.WGMMA)


SUB_N = 128  # columns per consumer wgmma in the warp-specialized kernels: see _ws_scaled_parts


def _ws_scaled_scratch(
  plgpu, a_dtype, b_dtype, out_dtype, stages: int, block_m: int, block_n: int, column_scales: bool = True
) -> dict:
  """Shared memory of the warp-specialized fp8 kernels: a ring of operand and scale buffers, one output
  buffer per consumer (in SUB_N-wide column blocks), and the ring's barriers (a step's copies; both
  consumers' releases). Without `column_scales` (b scales per tile and step, read by the consumers from
  global memory) the ring holds no b scales."""
  scratch = dict(
    a_smem=plgpu.SMEM((stages, block_m, BLOCK_K), a_dtype),
    sa_smem=plgpu.SMEM((stages, 1, block_m), jnp.float32),
    b_smem=plgpu.SMEM((stages, block_n, BLOCK_K), b_dtype),
    o_smem=plgpu.SMEM((2, block_n // SUB_N, block_m // 2, SUB_N), out_dtype),
    loaded=plgpu.Barrier(num_arrivals=4 if column_scales else 3, num_barriers=stages),
    consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  )
  if column_scales:
    scratch["sb_smem"] = plgpu.SMEM((stages, 1, block_n), jnp.float32)
  return scratch


def _ws_scaled_parts(plgpu, pl, half_m: int, block_n: int):
  """The consumer's K step and its carry, shared by the warp-specialized fp8 kernels: each of the two
  consumer warpgroups owns `half_m` rows of a (2 * half_m, block_n) tile.

  The carry is a tuple of fp32 (half_m, SUB_N) column blocks. A step runs one wgmma per column block
  into a fresh partial and promotes it (partial * row scale * column scale, added to the carry) before
  the next: the carry and one partial of a 128-wide block take 2 x 64 registers per thread, so a
  256-wide tile fits (128 + 64) where a 256-wide partial beside its carry would not (2 x 128). Wider
  tiles read fewer operand bytes per product: 1/128 + 1/256 per element of K instead of 2/128.

  `mma` runs a step; `issue` and `promote` are its halves for the wgrad kernel's overlap_promotion (one
  column block)."""
  subs = block_n // SUB_N

  def rows(wg):
    return pl.ds(pl.multiple_of(wg * half_m, half_m), half_m)

  def columns(j):
    return pl.ds(j * SUB_N, SUB_N)

  def issue(a_smem, b_smem, part_ref, wg, j=0):
    plgpu.wgmma(part_ref, a_smem.at[rows(wg)], b_smem.at[columns(j)].transpose((1, 0)))

  def fold(part, carry, sa, j, sb_smem, sb_tiles):
    """b's scales are per column (`sb_smem`) or one value per column block (`sb_tiles`)."""
    if sb_tiles is not None:  # a row scale times the block's b scale, then one multiply-add per element
      return carry + part * lax.broadcast_in_dim(sa * sb_tiles[j], (half_m, SUB_N), [0])
    sb = plgpu.load(sb_smem.at[0, columns(j)], layout=plgpu.Layout.WGMMA.reduce(0))
    return carry + part * lax.broadcast_in_dim(sa, (half_m, SUB_N), [0]) * lax.broadcast_in_dim(
      sb, (half_m, SUB_N), [1]
    )

  def row_scales(sa_smem, wg):
    return plgpu.load(sa_smem.at[0, rows(wg)], layout=plgpu.Layout.WGMMA.reduce(1))

  def fence_scales():
    # The scales were read through the generic proxy and the producer's next TMA into this slot writes
    # through the async proxy: fence them before the slot is released (wgmma reads need no fence).
    plgpu.commit_smem()

  def promote(sa_smem, part, carry, wg, sb_smem=None, sb_tiles=None):
    out = (fold(part, carry[0], row_scales(sa_smem, wg), 0, sb_smem, sb_tiles),)
    fence_scales()
    return out

  def mma(a_smem, sa_smem, b_smem, carry, wg, sb_smem=None, sb_tiles=None):
    sa = row_scales(sa_smem, wg)
    out = []
    for j in range(subs):

      def product(part_ref, j=j):
        issue(a_smem, b_smem, part_ref, wg, j)
        return part_ref[...]

      part = pl.run_scoped(product, plgpu.ACC((half_m, SUB_N), jnp.float32))
      out.append(fold(part, carry[j], sa, j, sb_smem, sb_tiles))
    fence_scales()
    return tuple(out)

  return mma, issue, promote, lambda: tuple(_zeros(plgpu, half_m, SUB_N) for _ in range(subs))


def scaled_ragged_dot(
  a,
  a_scale,
  b,
  b_scale,
  group_sizes,
  *,
  block_m=128,
  block_n=128,
  max_concurrent_steps=4,
  grid_block_n=4,
  out_dtype=jnp.bfloat16,
  interpret=False,
):
  """a [M, K] e4m3, a_scale [K/128, M'] f32 (M' >= M rounded up to block_m), b [G, N, K] e4m3, b_scale the
  weights' block scales [G, K/128, N/128] f32 -> [M, N] out_dtype. K a multiple of 128, N of block_n.

  A producer warpgroup keeps `max_concurrent_steps` K steps of operands and scales in flight across output
  tiles, and two consumer warpgroups each own block_m / 2 rows of a (block_m, block_n) tile; each waits for
  its own wgmma before promoting the partial, so the other's wgmma keeps the tensor cores busy meanwhile.
  Rows follow tile_schedule (no dead tiles). Each 128 columns of a tile share one weight scale per K step:
  the consumers read those values (from global memory, issued before the wgmma) and promote with one
  multiply-add per element."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  m, k = a.shape
  g, n, k2 = b.shape
  if k != k2 or k % BLOCK_K or n % block_n or block_m % 128 or block_n % SUB_N:
    raise ValueError(
      f"scaled_ragged_dot: a {a.shape}, b {b.shape}: K must match and be a multiple of {BLOCK_K}, "
      f"N of block_n={block_n}; block_m and block_n multiples of 128"
    )
  if a_scale.shape[1] < pl.cdiv(m, block_m) * block_m:
    raise ValueError(f"a_scale {a_scale.shape} must cover {pl.cdiv(m, block_m) * block_m} rows")
  if b_scale.shape != (g, k // BLOCK_K, n // BLOCK_K):
    raise ValueError(
      f"b_scale must be the weights' block scales [G, K/128, N/128] = {(g, k // BLOCK_K, n // BLOCK_K)}, "
      f"got {b_scale.shape}"
    )
  half_m, stages = block_m // 2, max_concurrent_steps
  group, block, first, owned = tile_schedule(group_sizes, m, block_m)
  grid_m, grid_n = group.shape[0], n // block_n
  mma, _, _, init_carry = _ws_scaled_parts(plgpu, pl, half_m, block_n)

  def body(group_gmem, block_gmem, first_gmem, owned_gmem, a_gmem, sa_gmem, b_gmem, sb_gmem, o_gmem):
    @functools.partial(
      pl.run_scoped,
      **_ws_scaled_scratch(plgpu, a.dtype, b.dtype, out_dtype, stages, block_m, block_n, column_scales=False),
      collective_axes="wg",
    )
    def _scope(a_smem, sa_smem, b_smem, o_smem, loaded, consumed):
      def tile_info(loop_info):
        mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, grid_block_n)
        return mi, ni, owned_gmem[mi], block_gmem[mi]

      def load(info, kb, slot, barrier):
        mi, ni, _, row_block = info
        rows, cols, ks = pl.ds(row_block * block_m, block_m), pl.ds(ni * block_n, block_n), pl.ds(kb * BLOCK_K, BLOCK_K)
        gi = group_gmem[mi]
        plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(sa_gmem.at[pl.ds(kb, 1), rows], sa_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(b_gmem.at[gi, cols, ks], b_smem.at[slot], barrier)

      def step(info, kb, slot, carry, wg):
        mi, ni, _, _ = info
        sb_tiles = [sb_gmem[group_gmem[mi], kb, ni * (block_n // SUB_N) + j] for j in range(block_n // SUB_N)]
        return mma(a_smem.at[slot], sa_smem.at[slot], b_smem.at[slot], carry, wg, sb_tiles=sb_tiles)

      def store(info, acc, wg):
        mi, ni, count, row_block = info
        # This warpgroup's rows of the tile, [wg * half_m, (wg + 1) * half_m), that the tile owns.
        lo = jnp.maximum(first_gmem[mi], wg * half_m)
        hi = jnp.minimum(first_gmem[mi] + count, (wg + 1) * half_m)
        out = o_smem.at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read its buffer
        for j, part in enumerate(acc):
          out.at[j][...] = part.astype(out.dtype)
        plgpu.commit_smem()
        for j in range(len(acc)):
          store_rows(
            out.at[j],
            o_gmem,
            row_block * block_m + wg * half_m,
            lo - wg * half_m,
            jnp.maximum(hi - lo, 0),
            ni * block_n + j * SUB_N,
            half_m,
            SUB_N,
          )

      warp_specialized(
        tiles=(grid_m * grid_n,),
        tile_info=tile_info,
        num_steps=lambda info: jnp.where(info[2] > 0, k // BLOCK_K, 0),
        load=load,
        mma=step,
        store=store,
        stages=stages,
        loaded=loaded,
        consumed=consumed,
        init_carry=init_carry,
      )

  kernel = ws_kernel(body, jax.ShapeDtypeStruct((m, n), out_dtype), interpret)
  return kernel(group, block, first, owned, a, a_scale, b, b_scale)


def scaled_ragged_wgrad(
  a,
  a_scale,
  b,
  b_scale,
  group_sizes,
  *,
  block_m=128,
  block_n=128,
  max_concurrent_steps=4,
  grid_block_n=1,
  out_dtype=jnp.bfloat16,
  interpret=False,
  overlap_promotion=False,
):
  """The weight gradient, warp-specialized like scaled_ragged_dot: (block_m, block_n) tiles
  of each group's weight gradient, K steps over the group's 128-row blocks.

  Operands are row-block-major: a [R/128, K, 128] (x's rows j*128..j*128+127 of column k at a[j, k]),
  b [R/128, N, 128]; each TMA load takes one row block of block_m columns, contraction contiguous as
  fp8 wgmma wants. XLA writes this layout in the quantisation pass itself; a plain [K, R] transpose
  costs it a second pass over the operand (benchmarks/results/2026-12-03-h200-fp8-block-scales).

  overlap_promotion (block_n = 128): each consumer issues a pair of K steps' wgmmas before promoting the
  first (mosaic_pipeline.warp_specialized), so the tensor cores keep working while it scales and adds.
  Measured 4-8% faster here (each column has its own scale: a promotion of two multiplies and an add);
  no faster in the forward kernels."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  row_blocks, k, a_block = a.shape
  row_blocks2, n, b_block = b.shape
  g = group_sizes.shape[0]
  if (
    row_blocks != row_blocks2
    or a_block != BLOCK_K
    or b_block != BLOCK_K
    or k % block_m
    or n % block_n
    or block_m % 128
    or block_n % SUB_N
  ):
    raise ValueError(
      f"scaled_ragged_wgrad: a {a.shape}, b {b.shape}: [row blocks, K or N, {BLOCK_K}] with the same row blocks; "
      f"K a multiple of block_m={block_m}, N of block_n={block_n} (both multiples of 128)"
    )
  if overlap_promotion and block_n != SUB_N:
    raise ValueError(f"overlap_promotion: block_n must be {SUB_N} (got {block_n})")
  half_m, stages = block_m // 2, max_concurrent_steps
  sizes = group_sizes.astype(jnp.int32)
  first_blocks = (jnp.cumsum(sizes) - sizes) // BLOCK_K
  grid_k, grid_n = k // block_m, n // block_n
  mma, issue, promote, init_carry = _ws_scaled_parts(plgpu, pl, half_m, block_n)

  def body(sizes_gmem, first_blocks_gmem, a_gmem, sa_gmem, b_gmem, sb_gmem, o_gmem):
    @functools.partial(
      pl.run_scoped,
      **_ws_scaled_scratch(plgpu, a.dtype, b.dtype, out_dtype, stages, block_m, block_n),
      collective_axes="wg",
    )
    def _scope(a_smem, sa_smem, b_smem, o_smem, loaded, consumed, sb_smem):
      def tile_info(loop_info):
        gi = loop_info.index[0]
        ki, ni = plgpu.planar_snake(loop_info.index[1], (grid_k, grid_n), 1, grid_block_n)
        return gi, ki, ni

      def load(info, j, slot, barrier):
        gi, ki, ni = info
        jb = first_blocks_gmem[gi] + j
        ks, cols = pl.ds(ki * block_m, block_m), pl.ds(ni * block_n, block_n)
        plgpu.copy_gmem_to_smem(a_gmem.at[jb, ks], a_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(sa_gmem.at[pl.ds(jb, 1), ks], sa_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(b_gmem.at[jb, cols], b_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(sb_gmem.at[pl.ds(jb, 1), cols], sb_smem.at[slot], barrier)

      def store(info, acc, wg):  # an empty group stores its zero carry: its gradient is zero
        gi, ki, ni = info
        out = o_smem.at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for j, part in enumerate(acc):
          out.at[j][...] = part.astype(out.dtype)
        plgpu.commit_smem()
        for j in range(len(acc)):
          plgpu.copy_smem_to_gmem(
            out.at[j], o_gmem.at[gi, pl.ds(ki * block_m + wg * half_m, half_m), pl.ds(ni * block_n + j * SUB_N, SUB_N)]
          )

      if overlap_promotion:
        steps = {
          "mma": lambda info, j, slot, part_ref, wg: issue(a_smem.at[slot], b_smem.at[slot], part_ref, wg),
          "promote": lambda info, j, slot, part, carry, wg: promote(
            sa_smem.at[slot], part, carry, wg, sb_smem=sb_smem.at[slot]
          ),
        }
      else:
        steps = {
          "mma": lambda info, j, slot, carry, wg: mma(
            a_smem.at[slot], sa_smem.at[slot], b_smem.at[slot], carry, wg, sb_smem=sb_smem.at[slot]
          )
        }
      warp_specialized(
        tiles=(g, grid_k * grid_n),
        tile_info=tile_info,
        num_steps=lambda info: sizes_gmem[info[0]] // BLOCK_K,
        load=load,
        store=store,
        stages=stages,
        loaded=loaded,
        consumed=consumed,
        init_carry=init_carry,
        **steps,
      )

  kernel = ws_kernel(body, jax.ShapeDtypeStruct((g, k, n), out_dtype), interpret)
  return kernel(sizes, first_blocks.astype(jnp.int32), a, a_scale, b, b_scale)
