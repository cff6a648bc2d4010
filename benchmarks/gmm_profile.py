"""Where a grouped GEMM's time goes: per-kernel device time (CUPTI) of fwd+bwd, per expert GEMM.

  python benchmarks/gmm_profile.py --out DIR [--iters 5]
  python benchmarks/gmm_profile.py --out DIR --gemms mosaic --quant fp8_blockwise --cases 8:balanced

For each DeepSeek-V3 expert shape and G in {4, 32} (balanced and skewed group sizes, as in
grouped_gemm.py; --cases to choose), runs the forward and backward of each unquantised expert GEMM of
the registry (MaxText/gmm/) on Mosaic GPU kernels (`mosaic`) and of JAX's own kernels as a peer
(jax_ragged_dot_mgpu, as in grouped_gemm.py) (--gemms to choose, any unquantised entry allowed), and of
each --quant quantised GEMM (registry names, as grouped_gemm.py's --quant), and records every kernel
launch's median time and name, split into Mosaic GPU kernels and the rest (for the quantised GEMMs:
the quantisation, layout and scale passes around the kernels).
It also counts, for the forward/dgrad kernels, the row-tile slots a static grid of
cdiv(M, block_m) + G - 1 holds and how many own rows (the rest are dead slots), and for wgrad how many
group boundaries fall inside a row block (blocks that need masking). Writes gmm_profile.json and .md.
"""

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from grouped_gemm import (  # noqa: E402
  M,
  PEER,
  SHAPES,
  check_quant,
  jax_inputs,
  jax_peer_gemm,
  parse_cases,
  quant_entries,
)


def gemm_choices() -> list[str]:
  """--gemms' names: every unquantised registry entry on contiguous groups (padded takes the equal-capacity
  layout: grouped_gemm.py times it on that), and JAX's kernels (the peer)."""
  from MaxText import gmm

  return [*(n for n, e in gmm.EXPERT_GEMMS.items() if not e.quantization and e.backend != "padded"), PEER]


def default_gemms() -> list[str]:
  """The unquantised registry entries on our Mosaic kernels, and the peer."""
  from MaxText import gmm

  return [*(n for n, e in gmm.EXPERT_GEMMS.items() if not e.quantization and e.backend == "mosaic"), PEER]


def tile_counts(sizes: np.ndarray, block_m: int, block_k: int) -> dict:
  ends = np.cumsum(sizes)
  starts = ends - sizes
  live = int(sum((e - 1) // block_m - s // block_m + 1 for s, e in zip(starts, ends) if e > s))
  slots = -(-M // block_m) + len(sizes) - 1
  masked = int(sum((s % block_k != 0) + (e % block_k != 0) for s, e in zip(starts, ends) if e > s))
  return {
    "row_tile_slots": slots,
    "live_row_tiles": live,
    "dead_fraction": 1 - live / slots,
    "wgrad_masked_blocks_per_tile_column": masked,
  }


def per_kernel(fn, args, iters: int) -> list[dict]:
  import jax
  from jax.experimental.mosaic.gpu import profiler

  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  _, timings = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
  # timings: one list per iteration of (kernel name, ms)
  names = [name for name, _ in timings[0]]
  return [{"kernel": name, "ms": statistics.median(it[i][1] for it in timings)} for i, name in enumerate(names)]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument(
    "--gemms",
    default="",
    help="comma-separated unquantised expert GEMMs: registry names or jax_ragged_dot_mgpu "
    "(default: the registry's entries on Mosaic kernels, and jax_ragged_dot_mgpu)",
  )
  ap.add_argument(
    "--quant",
    default="",
    help="comma-separated quantised expert GEMMs to profile too: registry names (mxfp8:mosaic, mxfp8:block_scaled, "
    "fp8_blockwise:mosaic, ...), a bare quantization (what it runs here with moe_gmm_backend=auto), or all",
  )
  ap.add_argument("--cases", default="4:balanced,32:balanced,32:skewed", help="comma-separated GROUPS:SIZES")
  args = ap.parse_args()
  cases = parse_cases(ap, args.cases)

  quant = check_quant(ap, args.quant)
  gemms = [g for g in args.gemms.split(",") if g] or default_gemms()
  if unknown := [g for g in gemms if g not in gemm_choices()]:
    ap.error(f"--gemms {','.join(unknown)}: choose from {', '.join(gemm_choices())}")

  import jax

  from MaxText import gmm
  from MaxText.kernels import mosaic_tiles

  variants = {name: jax_peer_gemm if name == PEER else lambda name=name: gmm.build(name) for name in gemms}
  variants.update({name: lambda name=name: gmm.build(name) for name in quant_entries(quant, jax.devices()[0])})
  args.out.mkdir(parents=True, exist_ok=True)
  results = {"machine": machine.describe(), "rows_M": M, "cases": []}
  lines = [
    "| shape | G | sizes | expert GEMM | total ms | TFLOP/s | Mosaic kernels ms | other ms | kernels (ms) "
    "| dead row-tile slots |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (shape, (k, n)), (g, kind) in itertools.product(SHAPES.items(), cases):
    sizes_np, x, w, dy, sizes = jax_inputs(k, n, g, kind)
    tiles = mosaic_tiles.tiles("fwd", k, n, g)
    case = {
      "shape": shape,
      "k": k,
      "n": n,
      "groups": g,
      "sizes": kind,
      "tiles": tile_counts(sizes_np, tiles["block_m"], mosaic_tiles.tiles("wgrad", k, n, g)["block_k"]),
      "runs": {},
    }
    for label, make in variants.items():
      try:
        f = make()

        @jax.jit
        def run(x, w, dy, f=f):
          y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
          return y, *vjp(dy)

        kernels = per_kernel(run, (x, w, dy), args.iters)
        total = sum(r["ms"] for r in kernels)
        in_mosaic = sum(r["ms"] for r in kernels if "mosaic_gpu" in r["kernel"])
        case["runs"][label] = {
          "kernels": kernels,
          "total_ms": total,
          "mosaic_ms": in_mosaic,
          "tflops": 6.0 * M * k * n / total / 1e9,
        }
        summary = ", ".join(f"{r['kernel'][:40]} {r['ms']:.3f}" for r in kernels if r["ms"] > 0.01)
        lines.append(
          f"| {shape} | {g} | {kind} | {label} | {total:.3f} | {case['runs'][label]['tflops']:.0f} | {in_mosaic:.3f} "
          f"| {total - in_mosaic:.3f} | {summary} | {case['tiles']['dead_fraction']:.3f} |"
        )
      except Exception as e:
        case["runs"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      print(shape, g, kind, label, case["runs"][label], flush=True)
    results["cases"].append(case)
    (args.out / "gmm_profile.json").write_text(json.dumps(results, indent=1))
  (args.out / "gmm_profile.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
