"""Hopper (sm_90) grouped GEMM on JAX's Pallas Mosaic GPU kernels, with our VJP and tiling.

Forward and dgrad use `ragged_dot_mgpu.ragged_dot` (dgrad with transpose_rhs, so
w is never transposed in memory); wgrad uses `transposed_ragged_dot_mgpu`.
Group sizes stay on the device: no host synchronisation. The kernels need the
contraction and output widths to be tile multiples; other widths are
zero-padded here (exact) and sliced back. Any group sizes work, including
empty groups and all rows in one group; rows past sum(group_sizes) are not
written (see gmm/__init__.py).

Tiles come from `mosaic_tiles.json` (tuned on an H200 by
`benchmarks/grouped_gemm.py --tune`), keyed by kernel and (K, N); untuned
shapes get DEFAULT_TILES, measured best at DeepSeek-V3's gate/up shape.
"""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from MaxText.moe.gmm.vjp import grouped_gemm_with_vjp

TILES_FILE = Path(__file__).with_name("mosaic_tiles.json")
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
DEFAULT_TILES = {"fwd": (128, 128, 64, 5, 4), "dgrad": (128, 128, 64, 5, 4), "wgrad": (128, 128, 64, 4, 1)}
TILE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
PAD = 128  # widths are padded to this multiple (a multiple of every block size used)


@functools.cache
def tuned_tiles() -> dict:
  return json.loads(TILES_FILE.read_text())["tiles"] if TILES_FILE.exists() else {}


def tiles_for(kernel: str, k: int, n: int) -> dict:
  """Tile parameters for `kernel` contracting width k into width n (both as padded)."""
  tiles = tuned_tiles().get(f"{kernel}:{k}x{n}", DEFAULT_TILES[kernel])
  return dict(zip(TILE_NAMES, tiles))


def _pad(a: jax.Array, axis: int) -> jax.Array:
  extra = -a.shape[axis] % PAD
  if not extra:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, extra)
  return jnp.pad(a, widths)


def _check_dtype(*arrays):
  for a in arrays:
    if a.dtype not in (jnp.bfloat16, jnp.float16):
      raise TypeError(f"moe_gmm_backend=mosaic runs bf16/fp16 tensor-core kernels; got {a.dtype} (set dtype=bfloat16)")


def _fwd(x, w, group_sizes):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  _check_dtype(x, w)
  group_sizes = group_sizes.astype(jnp.int32)
  n = w.shape[2]
  xp, wp = _pad(x, 1), _pad(_pad(w, 1), 2)
  y = ragged_dot_mgpu.ragged_dot(xp, wp, group_sizes=group_sizes, **tiles_for("fwd", wp.shape[1], wp.shape[2]))
  return y[:, :n]


def _dgrad(dy, w, group_sizes):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  group_sizes = group_sizes.astype(jnp.int32)
  k = w.shape[1]
  dyp, wp = _pad(dy, 1), _pad(_pad(w, 1), 2)
  tiles = tiles_for("dgrad", wp.shape[2], wp.shape[1])
  dx = ragged_dot_mgpu.ragged_dot(dyp, wp, group_sizes=group_sizes, transpose_rhs=True, **tiles)
  return dx[:, :k]


def _wgrad(x, dy, group_sizes):
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

  group_sizes = group_sizes.astype(jnp.int32)
  k, n = x.shape[1], dy.shape[1]
  xp, dyp = _pad(x, 1), _pad(dy, 1)
  tiles = tiles_for("wgrad", xp.shape[1], dyp.shape[1])
  dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(xp, dyp, group_sizes=group_sizes, **tiles)
  return dw[:, :k, :n]


gmm = grouped_gemm_with_vjp(_fwd, _dgrad, _wgrad)
