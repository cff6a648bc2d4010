"""Tile parameters of the bf16 Mosaic GPU grouped-GEMM kernels (mosaic_gmm.py), by kernel and shape.

Tuned entries come from `mosaic_tiles.json` (measured on an H200 by `benchmarks/grouped_gemm.py --tune`),
keyed "KERNEL:KxN" with optional group-count regimes ("fwd:7168x4096:g32"); untuned shapes get DEFAULT_TILES.
"""

import functools
import json
import math
from pathlib import Path

TILES_FILE = Path(__file__).with_name("mosaic_tiles.json")
KERNELS = ("fwd", "dgrad", "wgrad")
TILE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
# The kernels split a tile between two consumer warpgroups: block_n (fwd, dgrad) or block_m (wgrad) is
# each one's half. 3 stages of 48 KiB and two 32 KiB output buffers fill the 227 KiB of shared memory.
DEFAULT_TILES = {
  "fwd": (128, 128, 64, 3, 4),
  "dgrad": (128, 128, 64, 3, 4),
  "wgrad": (128, 128, 64, 3, 1),
}
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


def tiles(kernel: str, k: int, n: int, groups: int) -> dict:
  """tiles_for, with the split dimension halved where the padded width does not hold two halves."""
  chosen = tiles_for(kernel, k, n, groups)
  split, width = ("block_m", k) if kernel == "wgrad" else ("block_n", n)
  if width % (2 * chosen[split]):
    chosen[split] = PAD // 2  # widths are padded to 128 = 2 x 64
  return chosen
