"""Where a Mosaic grouped GEMM's time goes: per-kernel device time (CUPTI) of fwd+bwd, per kernel set.

  python benchmarks/gmm_profile.py --out DIR [--iters 5]
  python benchmarks/gmm_profile.py --out DIR --kernel-sets ours_ws --quant fp8_blockwise --cases 8:balanced

For each DeepSeek-V3 expert shape and G in {4, 32} (balanced and skewed group sizes, as in
grouped_gemm.py; --cases to choose), runs the forward and backward of `mosaic.make_gmm(kernels)` for
every kernel set (--kernel-sets to choose) and of each --quant quantised GEMM, and records every kernel
launch's median time and name, split into Mosaic GPU kernels and the rest (for the quantised GEMMs:
the quantisation, layout and scale passes XLA runs around the kernels).
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
from grouped_gemm import M, SHAPES, jax_inputs, machine, parse_cases  # noqa: E402


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
  ap.add_argument("--kernel-sets", default="", help="comma-separated Mosaic kernel sets (default: all)")
  ap.add_argument(
    "--quant",
    default="",
    help="comma-separated quantizations to profile too (mosaic+<q>): fp8_blockwise,mxfp8; "
    "fp8_blockwise:VARIANT for one of fp8_blockwise.MOSAIC_VARIANTS (plain, ws, ws_block_scales, ws_fused_quantize, ws_wide); "
    "mxfp8:IMPL for an mxfp8_impl (emulated, block_scaled)",
  )
  ap.add_argument("--cases", default="4:balanced,32:balanced,32:skewed", help="comma-separated GROUPS:SIZES")
  args = ap.parse_args()
  cases = parse_cases(ap, args.cases)

  import jax

  from MaxText.moe.gmm import mosaic
  from MaxText import quant

  if bad := [q for q in args.quant.split(",") if q and q not in quant.labels()]:
    ap.error(f"--quant {','.join(bad)}: choose from {', '.join(quant.labels())}")
  kernel_sets = [k for k in args.kernel_sets.split(",") if k] or list(mosaic.KERNELS)
  if unknown := [k for k in kernel_sets if k not in mosaic.KERNELS]:
    ap.error(f"--kernel-sets {','.join(unknown)}: choose from {', '.join(mosaic.KERNELS)}")
  args.out.mkdir(parents=True, exist_ok=True)
  results = {"machine": machine(), "rows_M": M, "cases": []}
  lines = [
    "| shape | G | sizes | kernels | total ms | TFLOP/s | Mosaic kernels ms | other ms | kernels (ms) | dead row-tile slots |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (shape, (k, n)), (g, kind) in itertools.product(SHAPES.items(), cases):
    sizes_np, x, w, dy, sizes = jax_inputs(k, n, g, kind)
    tiles = mosaic.tiles_for("fwd", k, n)
    case = {
      "shape": shape,
      "k": k,
      "n": n,
      "groups": g,
      "sizes": kind,
      "tiles": tile_counts(sizes_np, tiles["block_m"], mosaic.tiles_for("wgrad", k, n)["block_k"]),
      "runs": {},
    }
    variants = {f"mosaic:{name}": mosaic.make_gmm(name) for name in kernel_sets}
    variants.update({f"mosaic+{q}": quant.labelled_gmm(q, jax.devices()[0]) for q in args.quant.split(",") if q})
    for label, f in variants.items():

      @jax.jit
      def run(x, w, dy, f=f):
        y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
        return y, *vjp(dy)

      try:
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
          f"| {shape} | {g} | {kind} | {label} | {total:.3f} | {case['runs'][label]['tflops']:.0f} | {in_mosaic:.3f} | {total - in_mosaic:.3f} | {summary} | {case['tiles']['dead_fraction']:.3f} |"
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
