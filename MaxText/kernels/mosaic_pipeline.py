"""What the Mosaic GPU grouped-GEMM kernels share: the row-tile schedule and the warp-specialized pipeline.

  tile_schedule      row tiles in group order, each with its group and the rows it owns; no dead tiles
                     (JAX's ragged_dot_mgpu walks cdiv(M, block_m) + G - 1 slots and runs a whole K loop
                     in each dead one: 31 of 287 tiles at G=32 balanced)
  store_rows         a partial row tile stored through TMA as a ladder of power-of-two row copies (a TMA
                     descriptor has a static shape)
  row_bookkeeping    per group, where its rows start and end within row blocks (the wgrad kernels mask a
                     group's first and last block only where a group boundary cuts it)
  warp_specialized   a producer warpgroup issues the TMA loads of the SM's whole tile sequence into a ring
                     of buffers, so the next tile's operands land while two consumer warpgroups finish and
                     store the current one
  ws_kernel          the persistent launch (one program per SM, three warpgroups)

Used by the bf16 kernels (mosaic_gmm.py) and the fp8 ones (mosaic_fp8_gmm.py).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.kernels.gpu import INTERPRET_SMS, num_sms


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


def row_bookkeeping(group_sizes, block_k: int):
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
  alone. The carry is a 1-tuple of a partial-shaped array (mosaic_fp8_gmm._ws_scaled_parts)."""
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


def swizzled(block_k: int, dtype):
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(block_k * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
