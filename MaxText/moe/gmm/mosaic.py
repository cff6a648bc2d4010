"""Hopper (sm_90) grouped GEMM on Pallas Mosaic GPU kernels, with our VJP and tiling.

Three kernel sets: our warp-specialized kernels (`ours_ws`, the default) and our
single-warpgroup ones (`ours`), both in `mosaic_kernels.py`, and JAX's
(`ragged_dot_mgpu`, `transposed_ragged_dot_mgpu`), the last two kept for comparison. Forward
and dgrad are a ragged dot (dgrad with transpose_rhs, so w is never transposed
in memory); wgrad is a ragged dot contracting the rows.
Group sizes stay on the device: no host synchronisation. The kernels need the
contraction and output widths to be tile multiples; other widths are
zero-padded here (exact) and sliced back. Any group sizes work, including
empty groups and all rows in one group; rows past sum(group_sizes) are not
written (see gmm/__init__.py).

Tiles come from `mosaic_tiles.json` (tuned on an H200 by
`benchmarks/grouped_gemm.py --tune`), keyed by kernel and (K, N), with optional
group-count regimes (":g32"); untuned shapes get DEFAULT_TILES, measured best at
DeepSeek-V3's gate/up shape.
"""

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from MaxText.moe.gmm.vjp import grouped_gemm_with_vjp

TILES_FILE = Path(__file__).with_name("mosaic_tiles.json")
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
# The warp-specialized kernels ("_ws") split a tile between two consumer warpgroups: block_n (fwd, dgrad) or
# block_m (wgrad) is each one's half. 3 stages of 48 KiB and two 32 KiB output buffers fill the 227 KiB of
# shared memory. Untuned on hardware.
DEFAULT_TILES = {
  "fwd": (128, 128, 64, 5, 4),
  "dgrad": (128, 128, 64, 5, 4),
  "wgrad": (128, 128, 64, 4, 1),
  "fwd_ws": (128, 128, 64, 3, 4),
  "dgrad_ws": (128, 128, 64, 3, 4),
  "wgrad_ws": (128, 128, 64, 3, 1),
}
TILE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
PAD = 128  # widths are padded to this multiple (a multiple of every block size used)


@functools.cache
def tuned_tiles() -> dict:
  return json.loads(TILES_FILE.read_text())["tiles"] if TILES_FILE.exists() else {}


def tiles_for(kernel: str, k: int, n: int, groups: int | None = None) -> dict:
  """Tile parameters for `kernel` contracting width k into width n (both as padded).

  Entries tuned for a group count ("fwd:7168x4096:g32") win over the plain entry; of those, the
  one tuned nearest (in log2) to `groups` is used, since short groups want other tiles.
  """
  table = tuned_tiles()
  base = f"{kernel}:{k}x{n}"
  tiles = table.get(base, DEFAULT_TILES[kernel])
  regimes = {int(key.rsplit(":g", 1)[1]): v for key, v in table.items() if key.startswith(base + ":g")}
  if groups and regimes:
    tiles = regimes[min(regimes, key=lambda g: abs(math.log2(g) - math.log2(groups)))]
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


def _jax_kernels():
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

  return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _our_kernels():
  from MaxText.moe.gmm import mosaic_kernels

  return mosaic_kernels.ragged_dot, mosaic_kernels.ragged_wgrad


def _our_ws_kernels():
  from MaxText.moe.gmm import mosaic_kernels

  return mosaic_kernels.ragged_dot_ws, mosaic_kernels.ragged_wgrad_ws


# "jax": JAX's ragged_dot_mgpu / transposed_ragged_dot_mgpu; "ours": mosaic_kernels.py (no dead tiles,
# boundary masks only where a group boundary falls inside a block); "ours_ws": ours, warp-specialized (a
# producer warpgroup's loads run ahead across output tiles; two consumer warpgroups share each tile).
KERNELS = {"jax": _jax_kernels, "ours": _our_kernels, "ours_ws": _our_ws_kernels}
WARP_SPECIALIZED = {"ours_ws"}


def tile_kernel(kernels: str, kernel: str) -> str:
  """The tile-table name of `kernel` ("fwd", "dgrad", "wgrad") in the named kernel set."""
  return f"{kernel}_ws" if kernels in WARP_SPECIALIZED else kernel


def _tiles(kernels: str, kernel: str, k: int, n: int, groups: int) -> dict:
  tiles = tiles_for(tile_kernel(kernels, kernel), k, n, groups)
  if kernels in WARP_SPECIALIZED:  # a tile dimension is split between two warpgroups: halve it if the width needs
    split, width = ("block_m", k) if kernel == "wgrad" else ("block_n", n)
    if width % (2 * tiles[split]):
      tiles[split] = PAD // 2  # widths are padded to 128 = 2 x 64
  return tiles


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
  # The kernels need at least one full row tile; tiny inputs (tests, decode) are padded with zero rows.
  return a if a.shape[0] >= rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def kernel_functions(kernels: str):
  """(fwd, dgrad, wgrad) on the named kernel set, with padding and tiles; see vjp.py for the signatures."""
  load = KERNELS[kernels]

  def fwd(x, w, group_sizes):
    ragged, _ = load()
    _check_dtype(x, w)
    m, n = x.shape[0], w.shape[2]
    xp, wp = _pad(x, 1), _pad(_pad(w, 1), 2)
    tiles = _tiles(kernels, "fwd", wp.shape[1], wp.shape[2], w.shape[0])
    y = ragged(_pad_rows(xp, tiles["block_m"]), wp, group_sizes=group_sizes.astype(jnp.int32), **tiles)
    return y[:m, :n]

  def dgrad(dy, w, group_sizes):
    ragged, _ = load()
    m, k = dy.shape[0], w.shape[1]
    dyp, wp = _pad(dy, 1), _pad(_pad(w, 1), 2)
    tiles = _tiles(kernels, "dgrad", wp.shape[2], wp.shape[1], w.shape[0])
    dx = ragged(
      _pad_rows(dyp, tiles["block_m"]), wp, group_sizes=group_sizes.astype(jnp.int32), transpose_rhs=True, **tiles
    )
    return dx[:m, :k]

  def wgrad(x, dy, group_sizes):
    _, transposed = load()
    k, n = x.shape[1], dy.shape[1]
    xp, dyp = _pad(x, 1), _pad(dy, 1)
    tiles = _tiles(kernels, "wgrad", xp.shape[1], dyp.shape[1], group_sizes.shape[0])
    dw = transposed(xp, dyp, group_sizes=group_sizes.astype(jnp.int32), **tiles)
    return dw[:, :k, :n]

  return fwd, dgrad, wgrad


@functools.cache
def make_gmm(kernels: str):
  """The differentiable grouped GEMM on the named kernel set."""
  if kernels not in KERNELS:
    raise ValueError(f"unknown moe_mosaic_kernels '{kernels}'; choose one of: {', '.join(KERNELS)}")
  return grouped_gemm_with_vjp(*kernel_functions(kernels))


DEFAULT_KERNELS = "ours_ws"  # measured, tuned: 1-9% faster fwd+bwd than "ours" on 9 of 10 rows (benchmarks/results/2026-12-03-h200-ws-kernels)
_fwd, _dgrad, _wgrad = kernel_functions(DEFAULT_KERNELS)  # for wrappers that quantise around them
gmm = make_gmm(DEFAULT_KERNELS)
