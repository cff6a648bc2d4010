"""Per-group row alignment, so that row blocks of a weight-gradient contraction never straddle groups.

The weight gradient dw[g] = x_g^T @ dy_g contracts over the rows of group g. Quantising x and dy
in blocks along rows (32 for mxfp8, 128 for fp8_blockwise) needs each block inside one group, and
group sizes are arbitrary. So rows are moved into an aligned layout where every group starts at
a multiple of `align` and is zero-filled up to the next one; blocks then never cross a boundary, and
the zero rows add nothing to the contraction. Both directions are row gathers by a materialised index
(gather.gather_rows): no scatter.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.gather import gather_rows


class Aligned(NamedTuple):
  dest: jax.Array  # [rows] int32: each row's position in the aligned layout (padded_rows for padding rows)
  source: jax.Array  # [padded_rows] int32: the row each aligned row holds (rows for zero rows)
  group_sizes: jax.Array  # [groups] int32: group sizes rounded up to `align`
  padded_rows: int  # static: rows + groups * (align - 1), rounded up to `align`


def align_groups(group_sizes: jax.Array, rows: int, align: int) -> Aligned:
  sizes = group_sizes.astype(jnp.int32)
  g = sizes.shape[0]
  padded_rows = -(-(rows + g * (align - 1)) // align) * align
  ends = jnp.cumsum(sizes)
  aligned_sizes = -(-sizes // align) * align
  aligned_starts = jnp.cumsum(aligned_sizes) - aligned_sizes
  r = jnp.arange(rows, dtype=jnp.int32)
  gid = jnp.searchsorted(ends, r, side="right", method="scan_unrolled").astype(
    jnp.int32
  )  # == groups for rows past the total
  safe = jnp.minimum(gid, g - 1)
  dest = jnp.where(gid < g, aligned_starts[safe] + r - (ends[safe] - sizes[safe]), padded_rows)
  # The inverse map: aligned row ra of group ga holds row starts[ga] + (ra - aligned_starts[ga]) if that
  # is inside the group, else nothing.
  # (Aligned rows past the last group fall in it, clamped, beyond its size.)
  ra = jnp.arange(padded_rows, dtype=jnp.int32)
  ga = jnp.minimum(
    jnp.searchsorted(aligned_starts + aligned_sizes, ra, side="right", method="scan_unrolled"), g - 1
  ).astype(jnp.int32)
  within = ra - aligned_starts[ga]
  source = jnp.where(within < sizes[ga], ends[ga] - sizes[ga] + within, rows)
  return Aligned(dest, source, aligned_sizes, padded_rows)


def to_aligned(x: jax.Array, a: Aligned) -> jax.Array:
  """x [rows, ...] -> [padded_rows, ...]: rows at their aligned positions, zeros elsewhere."""
  return gather_rows(x, a.source)


def from_aligned(xa: jax.Array, a: Aligned) -> jax.Array:
  """Inverse of to_aligned; padding rows come back as zeros."""
  return gather_rows(xa, a.dest)


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
  """[rows] int32 group of each row, clamped to the last group for rows past the total (never read)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  gid = jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right", method="scan_unrolled")
  return jnp.minimum(gid, group_sizes.shape[0] - 1).astype(jnp.int32)
