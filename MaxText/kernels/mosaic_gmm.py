"""bf16 grouped GEMMs for Hopper (sm_90) in Pallas Mosaic GPU, warp-specialized.

  ragged_dot    y = x @ w[g] per row group (forward), or dy @ w[g]^T (dgrad, transpose_rhs: w is never
                transposed in memory); (block_m, 2 * block_n) output tiles, each consumer warpgroup
                computing and storing one half
  ragged_wgrad  dw[g] = x_g^T @ dy_g; (2 * block_m, block_n) output tiles

Rows follow mosaic_pipeline.tile_schedule (live tiles only, in group order) and both kernels run on the
warp-specialized pipeline (mosaic_pipeline.warp_specialized): a producer warpgroup keeps the SM's next
operands in flight while two consumers multiply and store. The weight-gradient kernel masks a group's
first and last row block only where a group boundary cuts it (JAX's transposed_ragged_dot_mgpu masks
them always, a register round trip of two blocks per output tile).

On an H200 they are 1.07-1.25x torch._grouped_mm and 0.88-0.98x the dense GEMM forward+backward at
DeepSeek-V3's shapes (benchmarks/results/2026-12-03-h200-ws-kernels; the single-warpgroup kernels and
JAX's ragged_dot_mgpu they replaced are measured there too). Shapes must be tile multiples:
`fwd`, `dgrad` and `wgrad` at the end take any widths (zero-padded) with tiles from mosaic_tiles.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.kernels.mosaic_tiles import PAD, tiles
from MaxText.kernels.padding import pad_rows, pad_to
from MaxText.kernels.mosaic_pipeline import (
  row_bookkeeping,
  store_rows,
  swizzled,
  tile_schedule,
  warp_specialized,
  ws_kernel,
)


def ragged_dot(
  lhs,
  rhs,
  group_sizes,
  *,
  block_m: int,
  block_n: int,
  block_k: int,
  max_concurrent_steps: int,
  grid_block_n: int,
  transpose_rhs: bool = False,
  interpret=False,
):
  """lhs [M, K] @ rhs[g] ([G, K, N], or [G, N, K] with transpose_rhs) per row group -> [M, N].

  (block_m, 2 * block_n) output tiles, each consumer warpgroup computing and storing one (block_m, block_n)
  half; rows from tile_schedule (dead slots take no steps). Rows past sum(group_sizes) are not written."""
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  cta_n = 2 * block_n
  if k % block_k or n % cta_n:
    raise ValueError(f"K={k} and N={n} must be multiples of block_k={block_k} and 2 * block_n={cta_n}")
  if block_m > m:
    raise ValueError(f"block_m={block_m} exceeds the {m} rows")
  stages = max_concurrent_steps
  group, block, first, owned = tile_schedule(group_sizes, m, block_m)
  grid_m, grid_n = group.shape[0], n // cta_n
  transforms = swizzled(block_k, lhs.dtype)
  b_block = (cta_n, block_k) if transpose_rhs else (block_k, cta_n)

  def body(group_gmem, block_gmem, first_gmem, owned_gmem, lhs_gmem, rhs_gmem, o_gmem):
    @functools.partial(
      pl.run_scoped,
      a_smem=plgpu.SMEM((stages, block_m, block_k), lhs.dtype, transforms=transforms),
      b_smem=plgpu.SMEM((stages, *b_block), rhs.dtype, transforms=transforms),
      o_smem=plgpu.SMEM((2, block_m, block_n), lhs.dtype),  # untiled: partial tiles are stored row ranges
      loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      collective_axes="wg",
    )
    def _scope(a_smem, b_smem, o_smem, loaded, consumed):
      def tile_info(loop_info):
        mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, grid_block_n)
        return mi, ni, owned_gmem[mi], block_gmem[mi]

      def num_steps(info):
        return jnp.where(info[2] > 0, k // block_k, 0)

      def load(info, kk, slot, barrier):
        mi, ni, _, row_block = info
        cols, ks = pl.ds(ni * cta_n, cta_n), pl.ds(kk * block_k, block_k)
        plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(row_block * block_m, block_m), ks], a_smem.at[slot], barrier)
        w = rhs_gmem.at[group_gmem[mi]]
        plgpu.copy_gmem_to_smem(w.at[cols, ks] if transpose_rhs else w.at[ks, cols], b_smem.at[slot], barrier)

      def mma(info, kk, slot, acc_ref, wg):
        half = pl.ds(pl.multiple_of(wg * block_n, block_n), block_n)
        b = b_smem.at[slot].at[half, :].transpose((1, 0)) if transpose_rhs else b_smem.at[slot].at[:, half]
        plgpu.wgmma(acc_ref, a_smem.at[slot], b)

      def store(info, acc, wg):
        mi, ni, count, row_block = info

        @pl.when(count > 0)
        def _():
          out = o_smem.at[wg]
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read its buffer
          out[...] = acc.astype(out.dtype)
          plgpu.commit_smem()
          store_rows(
            out, o_gmem, row_block * block_m, first_gmem[mi], count, ni * cta_n + wg * block_n, block_m, block_n
          )

      warp_specialized(
        tiles=(grid_m * grid_n,),
        tile_info=tile_info,
        num_steps=num_steps,
        load=load,
        mma=mma,
        store=store,
        acc_shape=(block_m, block_n),
        stages=stages,
        loaded=loaded,
        consumed=consumed,
      )

  return ws_kernel(body, jax.ShapeDtypeStruct((m, n), lhs.dtype), interpret)(group, block, first, owned, lhs, rhs)


def ragged_wgrad(
  x,
  dy,
  group_sizes,
  *,
  block_m: int,
  block_n: int,
  block_k: int,
  max_concurrent_steps: int,
  grid_block_n: int,
  interpret=False,
):
  """x [R, K], dy [R, N] -> dw [G, K, N], dw[g] = x_g^T @ dy_g over group g's rows.

  (2 * block_m, block_n) output tiles, each consumer warpgroup owning one (block_m, block_n) half. With 32
  groups a group's K loop is only ~16 blocks deep: a single-warpgroup kernel spends a pipeline fill per
  output tile, serialized with the tile's epilogue; here the next tile's operands land while the
  consumers store the previous tile.
  """
  rows, kdim = x.shape
  n = dy.shape[1]
  g = group_sizes.shape[0]
  cta_m = 2 * block_m
  if kdim % cta_m or n % block_n:
    raise ValueError(f"K={kdim} and N={n} must be multiples of 2 * block_m={cta_m} and block_n={block_n}")
  stages = max_concurrent_steps
  sizes, block_starts, num_blocks, head, tail = row_bookkeeping(group_sizes, block_k)
  transforms = swizzled(block_k, x.dtype)
  grid_m, grid_n = kdim // cta_m, n // block_n

  def body(sizes_gmem, block_starts_gmem, num_blocks_gmem, head_gmem, tail_gmem, x_gmem, dy_gmem, o_gmem):
    @functools.partial(
      pl.run_scoped,
      x_smem=plgpu.SMEM((stages, block_k, cta_m), x.dtype, transforms=transforms),
      dy_smem=plgpu.SMEM((stages, block_k, block_n), dy.dtype, transforms=transforms),
      o_smem=plgpu.SMEM((2, block_m, block_n), x.dtype, transforms=transforms),
      loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # the two copies of a step
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both consumer warpgroups
      collective_axes="wg",
    )
    def _scope(x_smem, dy_smem, o_smem, loaded, consumed):
      def tile_info(loop_info):
        gi = loop_info.index[0]
        mi, ni = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n), 1, grid_block_n)
        return gi, mi, ni

      def num_steps(info):
        return num_blocks_gmem[info[0]]

      def load(info, kk, slot, barrier):
        gi, mi, ni = info
        row = pl.ds(pl.multiple_of(block_starts_gmem[gi] + kk * block_k, block_k), block_k)
        plgpu.copy_gmem_to_smem(x_gmem.at[row, pl.ds(mi * cta_m, cta_m)], x_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(dy_gmem.at[row, pl.ds(ni * block_n, block_n)], dy_smem.at[slot], barrier)

      def mma(info, kk, slot, acc_ref, wg):
        gi = info[0]
        x_half = x_smem.at[slot].at[:, pl.ds(pl.multiple_of(wg * block_m, block_m), block_m)]
        head_rows, tail_row, last = head_gmem[gi], tail_gmem[gi], num_blocks_gmem[gi] - 1

        def mask_rows(keep):
          # Rows of a neighbouring group share this block: zero them in this warpgroup's half (where, not
          # a product, so that non-finite values there cannot leak in).
          idx = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (block_k, block_m), 0), plgpu.Layout.WGMMA)
          x_half[...] = jnp.where(keep(idx), x_half[...], jnp.zeros((), x_half.dtype))
          plgpu.commit_smem()

        @pl.when((kk == 0) & (head_rows != 0))
        def _():
          mask_rows(lambda i: i >= head_rows)

        @pl.when((kk == last) & (tail_row != block_k - 1))
        def _():
          mask_rows(lambda i: i <= tail_row)

        plgpu.wgmma(acc_ref, x_half.transpose((1, 0)), dy_smem.at[slot])

      def store(info, acc, wg):
        gi, mi, ni = info
        out = o_smem.at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read its buffer
        out[...] = acc.astype(out.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
          out, o_gmem.at[gi, pl.ds(mi * cta_m + wg * block_m, block_m), pl.ds(ni * block_n, block_n)]
        )

      warp_specialized(
        tiles=(g, grid_m * grid_n),
        tile_info=tile_info,
        num_steps=num_steps,
        load=load,
        mma=mma,
        store=store,
        acc_shape=(block_m, block_n),
        stages=stages,
        loaded=loaded,
        consumed=consumed,
      )

  return ws_kernel(body, jax.ShapeDtypeStruct((g, kdim, n), x.dtype), interpret)(
    sizes, block_starts, num_blocks, head, tail, x, dy
  )


# Any widths: padded to the tiles' multiple (zeros: exact) and sliced back, tiles from mosaic_tiles.py.
# The signatures are those of a grouped GEMM's three kernels (MaxText/gmm/vjp.py).


def _check_dtype(*arrays):
  for a in arrays:
    if a.dtype not in (jnp.bfloat16, jnp.float16):
      raise TypeError(f"moe_gmm_backend=mosaic runs bf16/fp16 tensor-core kernels; got {a.dtype} (set dtype=bfloat16)")


def fwd(x, w, group_sizes):
  """x [M, K] @ w[g] ([G, K, N]) -> [M, N]."""
  _check_dtype(x, w)
  m, n = x.shape[0], w.shape[2]
  xp, wp = pad_to(x, 1, PAD), pad_to(pad_to(w, 1, PAD), 2, PAD)
  t = tiles("fwd", wp.shape[1], wp.shape[2], w.shape[0])
  y = ragged_dot(pad_rows(xp, t["block_m"]), wp, group_sizes=group_sizes.astype(jnp.int32), **t)
  return y[:m, :n]


def dgrad(dy, w, group_sizes):
  """dy [M, N] @ w[g]^T -> [M, K], w read as it is (no transposed copy)."""
  m, k = dy.shape[0], w.shape[1]
  dyp, wp = pad_to(dy, 1, PAD), pad_to(pad_to(w, 1, PAD), 2, PAD)
  t = tiles("dgrad", wp.shape[2], wp.shape[1], w.shape[0])
  dx = ragged_dot(pad_rows(dyp, t["block_m"]), wp, group_sizes=group_sizes.astype(jnp.int32), transpose_rhs=True, **t)
  return dx[:m, :k]


def wgrad(x, dy, group_sizes):
  """x [M, K], dy [M, N] -> dw [G, K, N]."""
  k, n = x.shape[1], dy.shape[1]
  xp, dyp = pad_to(x, 1, PAD), pad_to(dy, 1, PAD)
  t = tiles("wgrad", xp.shape[1], dyp.shape[1], group_sizes.shape[0])
  dw = ragged_wgrad(xp, dyp, group_sizes=group_sizes.astype(jnp.int32), **t)
  return dw[:, :k, :n]
