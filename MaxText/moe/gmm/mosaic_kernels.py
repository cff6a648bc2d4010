"""Our Hopper grouped-GEMM kernels (Pallas Mosaic GPU), for when groups are many and short.

JAX's `ragged_dot_mgpu` walks a static grid of cdiv(M, block_m) + G - 1 row
tiles and finds each tile's group in the kernel; a grid slot that belongs to
no group still runs its whole K loop and stores nothing. With G=32 balanced
groups of 1024 rows that is 31 dead tiles in 287 (11% of the work). Here the
tile schedule is computed once per call by XLA (a few int32 vectors of length
cdiv(M, block_m) + G - 1): live tiles first, in group order, each with its
group, row block and the rows it owns; dead slots skip the K loop.

The weight-gradient kernel likewise masks a group's first and last row block
only when the group boundary falls inside the block (`transposed_ragged_dot_mgpu`
masks them always, a register round trip of two blocks per output tile, which
at 16-block-deep groups is most of its lost time).

Both kernels are persistent (one program per SM) and store through TMA from one
staging buffer, so a tile's store overlaps the next tile's K loop; a partial
row tile is stored as a ladder of power-of-two row copies, since a TMA
descriptor has a static shape.

`ragged_dot_ws` and `ragged_wgrad_ws` (kernel set `ours_ws`, the default) are
the same schedules, warp-specialized (`warp_specialized`): a producer warpgroup
issues the TMA loads of the SM's whole tile sequence into a ring of buffers, so
the next tile's operands land while two consumer warpgroups finish and store
the current one. On an H200 they are 1.07-1.25x torch._grouped_mm and 0.88-0.98x
the dense GEMM fwd+bwd at DeepSeek-V3's shapes
(benchmarks/results/2026-12-03-h200-ws-kernels).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

HOPPER_SMS = 132  # H100 SXM and H200: what compile-only devices (no core_count) are assumed to have
INTERPRET_SMS = 3  # in the interpreter: enough to share tiles between programs, few enough to run quickly


def num_sms() -> int:
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:  # no GPU backend: compiling for compile-only H100/H200 devices
    return HOPPER_SMS


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int):
  """Row tiles in group order: (group, row block, first owned row in the block, rows owned).

  Slots past the live tiles own 0 rows. A tile that straddles a group boundary appears once per
  group it holds rows of, each time owning only that group's rows.
  """
  g = group_sizes.shape[0]
  slots = pl.cdiv(m, block_m) + g - 1
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first_block = starts // block_m
  tiles_per_group = jnp.where(sizes > 0, (ends - 1) // block_m - first_block + 1, 0)
  tile_ends = jnp.cumsum(tiles_per_group)
  t = jnp.arange(slots, dtype=jnp.int32)
  # Unrolled: the default binary search is a loop, a kernel launch per level on a GPU.
  group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right", method="scan_unrolled"), g - 1).astype(jnp.int32)
  block = first_block[group] + t - (tile_ends[group] - tiles_per_group[group])
  lo = jnp.maximum(starts[group], block * block_m)
  hi = jnp.minimum(ends[group], (block + 1) * block_m)
  live = t < tile_ends[-1]
  owned = jnp.where(live, hi - lo, 0).astype(jnp.int32)
  block = jnp.where(live, block, 0).astype(jnp.int32)
  return group, block, (lo - block * block_m).astype(jnp.int32), owned


def store_rows(o_smem, o_gmem, row0, first, count, col, block_m: int, block_n: int):
  """Stores rows [first, first + count) of the tile in o_smem to o_gmem rows row0 + first ..."""

  @pl.when(count == block_m)
  def _():
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(row0, block_m), pl.ds(col, block_n)])

  @pl.when(count < block_m)
  def _():
    offset = first
    size = block_m // 2
    while size >= 1:
      step = size  # bound now: the closure below runs at trace time, inside this iteration

      @pl.when(count & step != 0)
      def _():
        plgpu.copy_smem_to_gmem(
          o_smem.at[pl.ds(offset, step)], o_gmem.at[pl.ds(row0 + offset, step), pl.ds(col, block_n)]
        )

      offset = offset + (count & step)
      size //= 2


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
  """lhs [M, K] grouped by rows, rhs [G, K, N] (or [G, N, K] with transpose_rhs) -> [M, N].

  `interpret`: False, or plgpu.InterpretGPUParams to run in Pallas' GPU interpreter (on CPU, with a few
  simulated SMs)."""
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if k % block_k or n % block_n:
    raise ValueError(f"K={k} and N={n} must be multiples of block_k={block_k} and block_n={block_n}")
  if block_m > m:
    raise ValueError(f"block_m={block_m} exceeds the {m} rows")
  group, block, first, owned = tile_schedule(group_sizes, m, block_m)
  grid_m, grid_n = group.shape[0], n // block_n

  def body(group_gmem, block_gmem, first_gmem, owned_gmem, lhs_gmem, rhs_gmem, o_gmem):
    # One output staging buffer for the whole kernel: a tile's store to HBM runs while the next tile
    # computes; only the next epilogue waits for it.
    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), dtype=o_gmem.dtype))
    def _scope(o_smem):
      @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
      def _tiles(loop_info):
        mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, grid_block_n)
        count = owned_gmem[mi]
        row_block = block_gmem[mi]

        def acc_scope(acc_ref):
          @pl.when(count > 0)
          def _():
            plgpu.emit_pipeline(
              lambda _, a_smem, b_smem: plgpu.wgmma(
                acc_ref, a_smem, b_smem.transpose((1, 0)) if transpose_rhs else b_smem
              ),
              grid=(k // block_k,),
              in_specs=[
                plgpu.BlockSpec((block_m, block_k), lambda kk: (row_block, kk), delay_release=1),
                plgpu.BlockSpec(
                  (block_n, block_k) if transpose_rhs else (block_k, block_n),
                  (lambda kk: (ni, kk)) if transpose_rhs else (lambda kk: (kk, ni)),
                  delay_release=1,
                ),
              ],
              max_concurrent_steps=max_concurrent_steps,
            )(lhs_gmem, rhs_gmem.at[group_gmem[mi]])

          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

        @pl.when(count > 0)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read o_smem
          o_smem[...] = acc.astype(o_smem.dtype)
          plgpu.commit_smem()
          store_rows(o_smem, o_gmem, row_block * block_m, first_gmem[mi], count, ni * block_n, block_m, block_n)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
    grid=(INTERPRET_SMS if interpret else num_sms(),),
    grid_names=("sm",),
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret,
  )
  return kernel(group, block, first, owned, lhs, rhs)


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
  """x [M, K], dy [M, N], rows grouped -> dw [G, K, N] with dw[g] = x_g^T dy_g (contracting rows)."""
  rows, kdim = x.shape
  n = dy.shape[1]
  g = group_sizes.shape[0]
  if kdim % block_m or n % block_n:
    raise ValueError(f"K={kdim} and N={n} must be multiples of block_m={block_m} and block_n={block_n}")
  # First/last row block of a group need masking only when the boundary is inside the block.
  sizes, block_starts, num_blocks, head, tail = _row_bookkeeping(group_sizes, block_k)

  swizzle = plgpu.find_swizzle(block_k * jnp.dtype(x.dtype).itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(x.dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
  grid_m, grid_n = kdim // block_m, n // block_n

  def body(sizes_gmem, block_starts_gmem, num_blocks_gmem, head_gmem, tail_gmem, x_gmem, dy_gmem, o_gmem):
    # As in ragged_dot: one staging buffer, each tile's store overlaps the next tile's K loop.
    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), dtype=o_gmem.dtype, transforms=transforms))
    def _scope(o_smem):
      @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
      def _tiles(loop_info):
        gi = loop_info.index[0]
        mi, ni = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n), 1, grid_block_n)
        rows_slice = pl.ds(pl.multiple_of(block_starts_gmem[gi], block_k), rows)
        last = num_blocks_gmem[gi] - 1
        head_rows, tail_row = head_gmem[gi], tail_gmem[gi]

        def acc_scope(acc_ref):
          def mask_rows(x_smem, keep):
            idx = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (block_k, block_m), 0), plgpu.Layout.WGMMA)
            x_smem[...] = x_smem[...] * keep(idx).astype(x_smem.dtype)
            plgpu.commit_smem()

          def step(kk, x_smem, dy_smem):
            kk = kk[0]

            @pl.when((kk == 0) & (head_rows != 0))
            def _():
              mask_rows(x_smem, lambda i: i >= head_rows)

            @pl.when((kk == last) & (tail_row != block_k - 1))
            def _():
              mask_rows(x_smem, lambda i: i <= tail_row)

            plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)
            if max_concurrent_steps == 1:
              plgpu.wgmma_wait(0)  # no delayed release: the next copy may overwrite what wgmma reads

          @pl.when(sizes_gmem[gi] > 0)
          def _():
            release = 1 if max_concurrent_steps > 1 else 0
            plgpu.emit_pipeline(
              step,
              grid=(num_blocks_gmem[gi],),
              in_specs=[
                plgpu.BlockSpec((block_k, block_m), lambda kk: (kk, mi), delay_release=release, transforms=transforms),
                plgpu.BlockSpec((block_k, block_n), lambda kk: (kk, ni), delay_release=release, transforms=transforms),
              ],
              max_concurrent_steps=max_concurrent_steps,
            )(x_gmem.at[rows_slice, :], dy_gmem.at[rows_slice, :])

          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read o_smem
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[gi, pl.ds(mi * block_m, block_m), pl.ds(ni * block_n, block_n)])

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((g, kdim, n), x.dtype),
    grid=(INTERPRET_SMS if interpret else num_sms(),),
    grid_names=("sm",),
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret,
  )
  # A group's row slice is `rows` long from its first block and may run past the end of x; the
  # pipeline only reads the group's own blocks, so the overhang is never touched.
  return kernel(sizes, block_starts, num_blocks, head, tail, x, dy)


def _row_bookkeeping(group_sizes, block_k: int):
  """Per group: first row block start, row blocks touched, rows of the previous group in the first block,
  and the group's last row within its last block (the wgrad kernels mask only where these cut a block)."""
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  block_starts = (starts // block_k * block_k).astype(jnp.int32)
  num_blocks = jnp.where(sizes > 0, (ends + block_k - 1) // block_k - starts // block_k, 0).astype(jnp.int32)
  head = (starts % block_k).astype(jnp.int32)
  tail = ((ends - 1) % block_k).astype(jnp.int32)
  return sizes, block_starts, num_blocks, head, tail


MEMORY_REGISTERS, COMPUTE_REGISTERS = 40, 232  # per thread: 2 x 232 + 40 warpgroups' worth fit the 64K register file


def warp_specialized(
  *,
  tiles,
  tile_info,
  num_steps,
  load,
  mma,
  store,
  stages: int,
  loaded,
  consumed,
  acc_shape=None,
  init_carry=None,
  promote=None,
):
  """The loop nest of a warp-specialized persistent kernel, run by warpgroups 0 and 1 (consumers) and 2
  (producer) of a program.

  The program's output tiles come from `plgpu.nd_loop(tiles)`; tile t takes num_steps(info) K steps. The
  producer issues every step's copies (`load(info, kk, slot, barrier)`) into a ring of `stages` buffers,
  numbering steps continuously across tiles, so it fills the next tile's buffers while the consumers
  finish and store the current one. Each consumer accumulates its part of the tile and stores it
  (`store(info, acc, wg)`), in one of three ways:
  - `acc_shape`: `mma(info, kk, slot, acc_ref, wg)` issues wgmma into an accumulator; one wgmma stays
    in flight, and a slot is released once the wgmma that read it is done;
  - `init_carry()`: `mma(info, kk, slot, carry, wg) -> carry` waits for its own wgmma (fp8 promotes
    each step's partial into an fp32 carry), and releases the slot as soon as it returns;
  - `init_carry()` and `promote`: `mma(info, kk, slot, part_ref, wg)` issues step kk's wgmma into a
    fresh partial accumulator and `promote(info, kk, slot, part, carry, wg) -> carry` folds a finished
    partial into the carry. Steps go in pairs, so step kk + 1's wgmma runs while step kk is promoted
    (`_overlapped_steps`).
  """
  wg = lax.axis_index("wg")
  in_flight = 1 if acc_shape is not None else 0

  def producer():
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    @plgpu.nd_loop(tiles, collective_axes="sm", init_carry=jnp.int32(0))
    def issued(loop_info, carry):
      info = tile_info(loop_info)
      nb = num_steps(info)

      @pl.loop(0, nb)
      def _(kk):
        step = carry + kk
        slot = lax.rem(step, stages)

        @pl.when(step >= stages)  # the slot was filled before: wait until both consumers are done with it
        def _():
          plgpu.barrier_wait(consumed.at[slot])

        load(info, kk, slot, loaded.at[slot])

      return carry + nb

    # Take the last releases, so that no barrier is left mid-phase when the kernel ends.
    @pl.loop(jnp.maximum(issued - stages, 0), issued)
    def _(step):
      plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

  def consumer():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

    @plgpu.nd_loop(tiles, collective_axes="sm", init_carry=jnp.int32(0))
    def _(loop_info, carry):
      info = tile_info(loop_info)
      nb = num_steps(info)

      def issue_step(kk, part_ref):
        slot = lax.rem(carry + kk, stages)
        plgpu.barrier_wait(loaded.at[slot])
        mma(info, kk, slot, part_ref, wg)

      def finish_step(kk, part, state):
        slot = lax.rem(carry + kk, stages)
        state = promote(info, kk, slot, part, state, wg)
        plgpu.barrier_arrive(consumed.at[slot])
        return state

      def steps(state, mma_step):
        def step(kk, state):
          step = carry + kk
          plgpu.barrier_wait(loaded.at[lax.rem(step, stages)])
          state = mma_step(kk, lax.rem(step, stages), state)
          plgpu.wgmma_wait(in_flight)
          if in_flight:

            @pl.when(kk > 0)  # the previous step's wgmma is done: release its slot
            def _():
              plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)])
          else:  # the step waited for its own wgmma: its slot is free now
            plgpu.barrier_arrive(consumed.at[lax.rem(step, stages)])
          return state

        state = lax.fori_loop(0, nb, step, state)
        if in_flight:
          plgpu.wgmma_wait(0)

          @pl.when(nb > 0)
          def _():
            plgpu.barrier_arrive(consumed.at[lax.rem(carry + nb - 1, stages)])

        return state

      if promote is not None:
        acc = _overlapped_steps(nb, init_carry(), issue=issue_step, finish=finish_step)
      elif acc_shape is not None:

        def acc_scope(acc_ref):
          def mma_step(kk, slot, state):
            mma(info, kk, slot, acc_ref, wg)  # accumulates in acc_ref: the loop carries nothing
            return state

          steps((), mma_step)
          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC(acc_shape))
      else:
        acc = steps(init_carry(), lambda kk, slot, state: mma(info, kk, slot, state, wg))
      store(info, acc, wg)
      return carry + nb

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  lax.cond(wg == 2, producer, consumer)


def _overlapped_steps(nb, init, *, issue, finish):
  """Steps 0..nb-1 of one tile in pairs: both steps' wgmmas are issued into fresh partial accumulators
  before the first partial is read (wgmma_wait(1) leaves the second in flight), so the first promotion
  overlaps the second MMA, and each consumer keeps two steps of MMA queued. A pair's partials live in
  one scope (a scope's accumulators start at zero, as each step's partial must); an odd last step runs
  alone. The carry is a 1-tuple of a partial-shaped array (fp8_mosaic._ws_scaled_parts)."""
  shape, dtype = init[0].shape, init[0].dtype

  def read(part_ref, in_flight):
    return plgpu.wgmma_accumulator_load(part_ref, wait_n=in_flight)

  def pair(i, state):
    def scope(p0, p1):
      issue(2 * i, p0)
      issue(2 * i + 1, p1)
      state2 = finish(2 * i, read(p0, 1), state)
      return finish(2 * i + 1, read(p1, 0), state2)

    return pl.run_scoped(scope, plgpu.ACC(shape, dtype), plgpu.ACC(shape, dtype))

  def last(state):
    def scope(p0):
      issue(nb - 1, p0)
      return finish(nb - 1, read(p0, 0), state)

    return pl.run_scoped(scope, plgpu.ACC(shape, dtype))

  state = lax.fori_loop(0, nb // 2, pair, init)
  return lax.cond(nb % 2 == 1, last, lambda state: state, state)


def ws_kernel(body, out_type, interpret):
  return plgpu.kernel(
    body,
    out_type=out_type,
    grid=(INTERPRET_SMS if interpret else num_sms(),),
    grid_names=("sm",),
    num_threads=3,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret,
  )


def _swizzled(block_k: int, dtype):
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(block_k * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def ragged_dot_ws(
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
  """ragged_dot, warp-specialized (see warp_specialized): (block_m, 2 * block_n) output tiles, each
  consumer warpgroup computing and storing one (block_m, block_n) half; rows as in ragged_dot's tile
  schedule (dead slots take no steps)."""
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  cta_n = 2 * block_n
  if k % block_k or n % cta_n:
    raise ValueError(f"K={k} and N={n} must be multiples of block_k={block_k} and 2 * block_n={cta_n}")
  if block_m > m:
    raise ValueError(f"block_m={block_m} exceeds the {m} rows")
  stages = max_concurrent_steps
  group, block, first, owned = tile_schedule(group_sizes, m, block_m)
  grid_m, grid_n = group.shape[0], n // cta_n
  transforms = _swizzled(block_k, lhs.dtype)
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


def ragged_wgrad_ws(
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
  """ragged_wgrad, warp-specialized (see warp_specialized): (2 * block_m, block_n) output tiles, each
  consumer warpgroup owning one (block_m, block_n) half.

  With 32 groups a group's K loop is only ~16 blocks deep, so the non-specialized kernel spends a
  pipeline fill per output tile, serialized with the tile's epilogue; here the next tile's operands
  land while the consumers store the previous tile.
  """
  rows, kdim = x.shape
  n = dy.shape[1]
  g = group_sizes.shape[0]
  cta_m = 2 * block_m
  if kdim % cta_m or n % block_n:
    raise ValueError(f"K={kdim} and N={n} must be multiples of 2 * block_m={cta_m} and block_n={block_n}")
  stages = max_concurrent_steps
  sizes, block_starts, num_blocks, head, tail = _row_bookkeeping(group_sizes, block_k)
  transforms = _swizzled(block_k, x.dtype)
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
