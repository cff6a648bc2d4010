"""Sort-based permutation of token copies into expert order, and back with a weighted combine.

Each of N tokens sends k copies (`expert_ids [N, k]`). `plan` sorts the copies stably by expert
id, so every expert's rows are contiguous and in token order, and records both directions of the
permutation as index vectors:

  row_copy [R]     for each row, the copy (token * k + slot) it holds; N * k for a padding row
  dest     [N, k]  for each copy, the row it lands in; R (out of range) for an ignored copy

Only these int32 vectors and the per-expert `group_sizes [E]` are built: no [tokens, experts]
mask, and no scatter anywhere (the inverse permutation is a second sort, group boundaries a
binary search of the sorted ids). Both data movements are gathers, and so are their gradients,
by the custom VJPs below:

  permute(x, plan)            rows[r] = x[row_copy[r] // k]          (0 for padding rows)
      backward                dx[t]   = sum_j drows[dest[t, j]]      gather by the inverse
  unpermute(y, w, plan)       out[t]  = sum_j w[t, j] * y[dest[t, j]]   in float32
      backward                dy[r]   = w[c] * dout[c // k], c = row_copy[r]   (0 for padding)
                              dw[t,j] = <dout[t], y[dest[t, j]]>        in float32

(XLA's own transpose of a gather is a scatter-add; here it is the gather the other way.)

Ignored copies: expert ids outside [0, num_experts) go to no group (A2's receive buffers mark
empty slots this way); their rows are zero, they add nothing to the combine and get zero
gradient.

Padding (`pad_multiple` m > 0): each expert's group is padded with zero rows up to a multiple of
m (the grouped GEMM's row tile), so no tile straddles two experts; `group_sizes` then include the
padding. R = N*k rounded up to m, plus E*(m-1) rows of room; rows past sum(group_sizes) are zero.
Without padding R = N*k and the ignored copies' zero rows sit past sum(group_sizes).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.gather import gather_rows


class Plan(NamedTuple):
  row_copy: jax.Array  # [R] int32: copy held by each row; N*k marks a padding row
  dest: jax.Array  # [N, k] int32: row of each copy; R for an ignored copy
  group_sizes: jax.Array  # [E] int32 rows per expert, padding included


def num_rows(copies: int, num_experts: int, pad_multiple: int = 0) -> int:
  """Static row count R of the permuted buffer for `copies` = N*k token copies."""
  if pad_multiple <= 1:
    return copies
  return -(-copies // pad_multiple) * pad_multiple + num_experts * (pad_multiple - 1)


def plan(expert_ids: jax.Array, num_experts: int, pad_multiple: int = 0) -> Plan:
  """The permutation for `expert_ids [N, k]`; ids outside [0, num_experts) are ignored."""
  n, k = expert_ids.shape
  copies = n * k
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # ignored copies sort last
  iota = jnp.arange(copies, dtype=jnp.int32)
  sorted_ids, order = jax.lax.sort((flat, iota), num_keys=1, is_stable=True)
  _, inverse = jax.lax.sort((order, iota), num_keys=1, is_stable=True)  # sorted position of each copy
  # starts[e] = first sorted position of expert e: a binary search (no histogram scatter), unrolled,
  # since a looped one costs a kernel launch per level (17 for 65,536 copies) on a GPU.
  bounds = jnp.searchsorted(
    sorted_ids, jnp.arange(num_experts + 1, dtype=jnp.int32), side="left", method="scan_unrolled"
  )
  starts, sizes = bounds[:-1].astype(jnp.int32), jnp.diff(bounds).astype(jnp.int32)
  ignored = flat == num_experts
  if pad_multiple <= 1:
    rows = copies
    row_copy = jnp.where(sorted_ids < num_experts, order, copies)
    dest = jnp.where(ignored, rows, inverse)
    return Plan(row_copy, dest.reshape(n, k), sizes)

  rows = num_rows(copies, num_experts, pad_multiple)
  padded = -(-sizes // pad_multiple) * pad_multiple
  padded_ends = jnp.cumsum(padded)
  padded_starts = padded_ends - padded
  shift = jnp.concatenate([padded_starts - starts, jnp.zeros((1,), jnp.int32)])  # ignored copies: unused
  dest = jnp.where(ignored, rows, inverse + shift[flat])
  # Row r belongs to the group whose padded range holds it; it is real if within the group's size.
  r = jnp.arange(rows, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(padded_ends, r, side="right", method="scan_unrolled"), num_experts - 1).astype(
    jnp.int32
  )
  within = r - padded_starts[group]
  real = (within < sizes[group]) & (r < padded_ends[-1])
  source = jnp.clip(starts[group] + within, 0, copies - 1)
  row_copy = jnp.where(real, order[source], copies)
  return Plan(row_copy, dest.reshape(n, k), padded.astype(jnp.int32))


def _int_zero(a: jax.Array) -> jax.Array:
  return jnp.zeros(a.shape, jax.dtypes.float0)


@jax.custom_vjp
def _permute(x, row_copy, dest):
  return gather_rows(x, row_copy // dest.shape[1])


def _permute_fwd(x, row_copy, dest):
  return _permute(x, row_copy, dest), (row_copy, dest)


def _permute_bwd(res, drows):
  row_copy, dest = res
  per_copy = gather_rows(drows, dest).astype(jnp.float32)  # [N, k, D]
  dx = jnp.sum(per_copy, axis=1).astype(drows.dtype)
  return dx, _int_zero(row_copy), _int_zero(dest)


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x: jax.Array, p: Plan) -> jax.Array:
  """x [N, D] -> rows [R, D] in expert order (each token once per copy; padding rows zero)."""
  return _permute(x, p.row_copy, p.dest)


def _combine(y, weights, dest):
  per_copy = gather_rows(y, dest).astype(jnp.float32)  # [N, k, D]
  return jnp.einsum("nkd,nk->nd", per_copy, weights.astype(jnp.float32))


@jax.custom_vjp
def _unpermute(y, weights, row_copy, dest):
  return _combine(y, weights, dest)


def _unpermute_fwd(y, weights, row_copy, dest):
  return _combine(y, weights, dest), (y, weights, row_copy, dest)


def _unpermute_bwd(res, dout):
  y, weights, row_copy, dest = res
  n, k = dest.shape
  dout = dout.astype(jnp.float32)
  w_row = gather_rows(weights.reshape(-1).astype(jnp.float32), row_copy)  # 0 on padding rows
  dy = (gather_rows(dout, row_copy // k) * w_row[:, None]).astype(y.dtype)
  dw = jnp.einsum("nkd,nd->nk", gather_rows(y, dest).astype(jnp.float32), dout).astype(weights.dtype)
  return dy, dw, _int_zero(row_copy), _int_zero(dest)


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute(y: jax.Array, weights: jax.Array, p: Plan, out_dtype=None) -> jax.Array:
  """rows y [R, D] -> [N, D]: each token's k rows summed with `weights [N, k]` in float32.

  The result is cast to `out_dtype` (default y.dtype); the float32 sum is differentiated, so the
  weights' gradient is exact in float32.
  """
  return _unpermute(y, weights, p.row_copy, p.dest).astype(out_dtype or y.dtype)
