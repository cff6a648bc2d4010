"""Tile parameters of the bf16 Mosaic GPU grouped-GEMM kernels (mosaic_gmm.py), by GPU, kernel and shape.

One tuned table per GPU (`mosaic_tiles_<gpu>.json` beside this file, measured by `benchmarks/grouped_gemm.py
--tune` on that GPU), chosen by the device kind of the GPU the kernels run on: the H100 has 30% less memory
bandwidth than the H200, which moves the best pipeline depth and grid. A GPU without a table of its own gets
the nearest one, and `table_note` says so (the start-up log prints it). Entries are keyed "KERNEL:KxN" with
optional group-count regimes ("fwd:7168x4096:g32"); untuned shapes get DEFAULT_TILES.
"""

import functools
import json
import math
from pathlib import Path

TABLES_DIR = Path(__file__).parent
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
# jax's device_kind (lower-cased) -> the table of the same chip, first match wins: the H800 is an H100 with
# less NVLink; the GH200's Hopper has HBM3e at about the H200's bandwidth.
TABLE_FOR_KIND = (("h200", "h200"), ("h100", "h100"), ("h800", "h100"))
NEAREST = ("h200", "h100")  # for other GPUs (and CPU interpretation): the first of these that exists


def table_name(device_kind: str) -> str:
  """The table tuned for `device_kind`'s chip ("h100", "h200"), or "" if none is known for it."""
  kind = device_kind.lower()
  return next((name for key, name in TABLE_FOR_KIND if key in kind), "")


def table_path(name: str) -> Path:
  return TABLES_DIR / f"mosaic_tiles_{name}.json"


def current_device_kind() -> str:
  """The kind of the GPU the kernels are lowered for: JAX's default device where one is set (the planner's
  compile-only GPUs, MaxText/compile_only.lowering_for), else the first local device ("cpu" when interpreted)."""
  import jax

  device = jax.config.jax_default_device or jax.devices()[0]
  if isinstance(device, str):  # a platform name
    device = jax.devices(device)[0]
  return device.device_kind


@functools.cache
def choose_table(device_kind: str) -> tuple[Path | None, str]:
  """(table file, one-line note saying which table the kernels use on `device_kind` and why)."""
  own = table_name(device_kind)
  if own and table_path(own).exists():
    return table_path(own), f"Mosaic tile table {table_path(own).name} (tuned on this GPU's chip, {device_kind})"
  nearest = next((table_path(n) for n in NEAREST if table_path(n).exists()), None)
  if nearest is None:
    return None, f"no Mosaic tile table for {device_kind}: default tiles"
  tuned_on = json.loads(nearest.read_text()).get("device", nearest.stem)
  return nearest, f"no Mosaic tile table for {device_kind}: using the nearest, {nearest.name} (tuned on {tuned_on})"


_override: list[Path] = []  # a table file that replaces the device's own (benchmarks/grouped_gemm.py --tune)


def use_table(path: Path | None) -> None:
  """Makes the kernels use the table in `path` (None: back to the device's own); traced functions keep theirs."""
  _override[:] = [Path(path)] if path else []


@functools.cache
def _entries(path: Path) -> dict:
  return json.loads(path.read_text())["tiles"]


def reload() -> None:
  """Forgets the tables read so far (after a table file was written)."""
  choose_table.cache_clear()
  _entries.cache_clear()


def tuned_tiles(device_kind: str | None = None) -> dict:
  """The tuned entries for `device_kind` (default: the kind current_device_kind gives)."""
  path = _override[0] if _override else choose_table(device_kind or current_device_kind())[0]
  return _entries(path) if path else {}


def table_note(device_kind: str | None = None) -> str:
  if _override:
    return f"Mosaic tile table {_override[0]} (given)"
  return choose_table(device_kind or current_device_kind())[1]


def tiles_for(kernel: str, k: int, n: int, groups: int | None = None, device_kind: str | None = None) -> dict:
  """Tile parameters for `kernel` contracting width k into width n (both as padded).

  Entries tuned for a group count ("fwd:7168x4096:g32") win over the plain entry; of those, the
  one tuned nearest (in log2) to `groups` is used, since short groups want other tiles. The table is
  `device_kind`'s (default: the current device's).
  """
  table = tuned_tiles(device_kind)
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
