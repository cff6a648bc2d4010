"""`quantization: mxfp8` on block-scaled matrix products (`mxfp8_impl: block_scaled`, Blackwell's path).

The same format and contractions as mxfp8.py, but the products take the e4m3 values and e8m0 scales
as they are, through jax.lax.scaled_dot: XLA compiles each into a Triton GEMM fusion whose tt.dot_scaled
is the tensor cores' block-scaled MMA on sm_100+ (the scales applied in the MMA). Elsewhere XLA
dequantises first (on an H200: its own fusions, then cuBLAS bf16 GEMMs, slower than the emulation, which
mxfp8_impl=auto runs there). (jax.nn.scaled_matmul, the cuDNN route, splits the scales wrongly when the SPMD
partitioner shards the contraction axis into pieces that are not whole blocks: NaN outputs on CPU; XLA
partitions scaled_dot itself.)

jax has no ragged block-scaled product, so the grouped GEMM is a loop of dense ones over row windows:
every group is cut into windows of `window` rows, each window one product against its group's weight.
Only windows that hold rows run (a dynamic trip count); a window's rows past its group's end belong to
the next group and are masked out of its result (forward, dgrad) or zeroed in its operands (wgrad,
where the contraction runs over rows, in the per-group 32-row alignment of quant/groups.py).
A data-dependent trip count makes XLA:GPU read the loop condition back on the host each iteration;
looping over the static bound instead (unused windows fully masked) measured 11-18% slower on an
H200, where each window is slow, and has not been measured where windows are fast (Blackwell).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.gmm import vjp
from MaxText.gmm.base import FunctionGemm
from MaxText.quant.formats import E8M0, MX_BLOCK, mx_quantize
from MaxText.quant.groups import align_groups, to_aligned

MIN_WINDOW, MAX_WINDOW = 128, 1024


def window_rows(rows: int, groups: int) -> int:
  """Rows per product: a power of two near a quarter of a group's average share, so that the part of
  each group's last window that is masked away (half a window on average) costs about 1/8 of the work,
  within [128, 1024]: wide enough to keep a GEMM efficient, narrow enough for many small groups."""
  share = max(rows // (4 * groups), 1)
  return min(max(1 << (share.bit_length() - 1), MIN_WINDOW), MAX_WINDOW)


class Windows(NamedTuple):
  start: jax.Array  # [T] int32: each window's first row
  group: jax.Array  # [T] int32: the group (weight) it multiplies
  rows: jax.Array  # [T] int32: how many of its rows are its group's (0 for windows past `count`)
  count: jax.Array  # int32: windows in use; the first `count` of the T


def windows(starts: jax.Array, sizes: jax.Array, window: int, total: int) -> Windows:
  """Cut groups (first row `starts`, `sizes` rows) into windows; `total` (static) bounds their number."""
  per_group = -(-sizes // window)
  ends = jnp.cumsum(per_group)
  t = jnp.arange(total, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(ends, t, side="right", method="scan_unrolled"), sizes.shape[0] - 1).astype(jnp.int32)
  j = t - (ends[g] - per_group[g])
  rows = jnp.where(t < ends[-1], jnp.clip(sizes[g] - j * window, 0, window), 0)
  return Windows(starts[g] + j * window, g, rows.astype(jnp.int32), ends[-1].astype(jnp.int32))


def max_windows(rows: int, groups: int, window: int) -> int:
  """At most one partial window per group beyond the full ones."""
  return -(-rows // window) + groups


def _product(a, b, a_scale, b_scale, like, out_dtype):
  """a [M, K] @ b [N, K]^T with blocks of 32 along K, the scales as their e8m0 bytes: one block-scaled
  product. Typed like `like` inside shard_map (the primitive's result carries no varying axes of its own)."""
  a_scale, b_scale = (jax.lax.bitcast_convert_type(s, E8M0) for s in (a_scale, b_scale))
  out = jax.lax.scaled_dot(
    a,
    b,
    lhs_scale=a_scale,
    rhs_scale=b_scale,
    dimension_numbers=(((1,), (1,)), ((), ())),
    preferred_element_type=out_dtype,
  )
  return vjp.typed(out, like)


def _pad(a: jax.Array, extra: int, axis: int = 0) -> jax.Array:
  return jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)])


def _in_bounds(start, n, window: int, length: int):
  """A window for positions [start, start + n) of an axis of `length` >= window positions: where it
  starts, moved back so that it ends inside the axis (no padded copy of the operands), and a mask of
  the wanted positions in it."""
  first = jnp.minimum(start, length - window)
  i = jnp.arange(window)
  return first, (i >= start - first) & (i < start - first + n)


def _quantize(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """MXFP8 along the last axis, zero-padded to whole blocks (the product infers its block size from the
  widths of values and scales; zeros change no block's amax): e4m3 values and the scales' bytes.

  Scales travel as bytes up to the product because e8m0 has no zero: padding them with e8m0's "zero"
  gives its NaN, and NaN times a padded zero value is NaN; the byte 0 is 2^-127."""
  q = mx_quantize(_pad(a, -a.shape[-1] % MX_BLOCK, a.ndim - 1), -1)
  return q.q, jax.lax.bitcast_convert_type(q.scale, jnp.uint8)


def _rows_times_groups(a, b, group_sizes: jax.Array, out_dtype) -> jax.Array:
  """out[r] = a[r] @ b[g(r)]^T for rows r of group g: a and b (values, scale bytes) from _quantize,
  a [rows, K], b [G, N, K]. Rows past the groups' total come out zero."""
  (aq, ascale), (bq, bscale) = a, b
  rows = aq.shape[0]
  groups, n = bq.shape[:2]
  window = window_rows(rows, groups)
  sizes = group_sizes.astype(jnp.int32)
  w = windows(jnp.cumsum(sizes) - sizes, sizes, window, max_windows(rows, groups, window))
  length = max(rows, window)  # fewer rows than a window: pad them (a small copy)
  aq, ascale = _pad(aq, length - rows), _pad(ascale, length - rows)
  out = vjp.typed(jnp.zeros((length, n), out_dtype), aq, bq, group_sizes)

  def body(t, out):
    first, keep = _in_bounds(w.start[t], w.rows[t], window, length)
    g = w.group[t]
    x = jax.lax.dynamic_slice_in_dim(aq, first, window)
    xs = jax.lax.dynamic_slice_in_dim(ascale, first, window)
    y = _product(x, bq[g], xs, bscale[g], out, out_dtype)
    return jax.lax.dynamic_update_slice_in_dim(
      out, jnp.where(keep[:, None], y, jax.lax.dynamic_slice_in_dim(out, first, window)), first, 0
    )

  return jax.lax.fori_loop(0, w.count, body, out)[:rows]


def fwd(x, w, group_sizes):
  """y = x @ w[g]: x in blocks of 32 along K, w [G, K, N] transposed to [G, N, K] in blocks of 32 along K."""
  return _rows_times_groups(_quantize(x), _quantize(jnp.swapaxes(w, 1, 2)), group_sizes, x.dtype)


def dgrad(dy, w, group_sizes):
  """dx = dy @ w[g]^T: dy and w in blocks of 32 along N (w [G, K, N] is already N-last)."""
  return _rows_times_groups(_quantize(dy), _quantize(w), group_sizes, dy.dtype)


def wgrad(x, dy, group_sizes):
  """dw[g] = x_g^T @ dy_g in float32: x and dy in blocks of 32 rows, rows aligned per group to 32."""
  rows, k = x.shape
  n, groups = dy.shape[1], group_sizes.shape[0]
  aligned = align_groups(group_sizes, rows, MX_BLOCK)
  window = window_rows(rows, groups)  # a power of two >= 128: whole 32-row blocks
  sizes = aligned.group_sizes
  w = windows(jnp.cumsum(sizes) - sizes, sizes, window, max_windows(aligned.padded_rows, groups, window))
  # Rows on the contraction axis, last: [K, rows] and [N, rows], blocks of 32 along rows; fewer rows than
  # a window are zero-padded (zero blocks quantise to scale byte 0).
  length = max(aligned.padded_rows, window)  # both multiples of 32: windows start on whole blocks
  xq, xs = _quantize(_pad(to_aligned(x, aligned), length - aligned.padded_rows).T)
  dq, ds = _quantize(_pad(to_aligned(dy, aligned), length - aligned.padded_rows).T)
  dw = vjp.typed(jnp.zeros((groups, k, n), jnp.float32), x, dy, group_sizes)

  def body(t, dw):
    first, keep = _in_bounds(w.start[t], w.rows[t], window, length)
    keep_block = keep[::MX_BLOCK]  # the windows' group rows are whole blocks
    g = w.group[t]

    def take(q, s):
      # Rows of other groups in the window: zero values with scale 2^-127 (byte 0), since a zero under
      # a NaN scale (a block holding Inf or NaN) would still be NaN.
      q = jax.lax.dynamic_slice_in_dim(q, first, window, axis=1)
      s = jax.lax.dynamic_slice_in_dim(s, first // MX_BLOCK, window // MX_BLOCK, axis=1)
      return jnp.where(keep, q, jnp.zeros((), q.dtype)), jnp.where(keep_block, s, jnp.uint8(0))

    (a, a_scale), (b, b_scale) = take(xq, xs), take(dq, ds)
    return dw.at[g].add(_product(a, b, a_scale, b_scale, dw, jnp.float32))

  return jax.lax.fori_loop(0, w.count, body, dw)


def make_gmm():
  return vjp.grouped_gemm_with_vjp(fwd, dgrad, wgrad)


def build(entry, options) -> FunctionGemm:
  return FunctionGemm(entry.name, make_gmm())
