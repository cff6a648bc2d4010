"""The GPU's measured bf16 dense GEMM rate: the peak that MFU "of the measured peak" divides by.

  python3 benchmarks/dense_peak.py --out DIR [--shapes 8192,16384,32768x7168x4096] [--iters 20]

bf16 GEMMs (N for N x N x N, or MxKxN) with fp32 accumulation (XLA's cuBLAS call: jnp.dot with
preferred_element_type float32, bf16 output) on random normal inputs, timed by device kernel time (CUPTI,
Mosaic GPU's profiler; host wall time if CUPTI is unavailable, said in the results) after warm-up, median
over iterations. The output is checked against a float32 product of the same bf16 inputs on a sample of
rows, so a wrong or skipped GEMM cannot pass as fast.

The measured peak is the fastest shape's rate. On an H100 the expert widths' GEMMs ran faster than 8192^3
(839 against 743 TFLOP/s: benchmarks/results/2026-12-06-h100-tiles-proxy), so the default shapes include
DeepSeek-V3's gate+up GEMM at 32768 rows. The published peak (MaxText/flops.py) is printed beside it.
Writes DIR/dense_peak.json.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402
from grouped_gemm import jax_time_ms  # noqa: E402

CHECK_ROWS = 64  # rows compared with the float32 product (the whole product in fp32 would double the memory)
BOUND = 1e-2  # relative Frobenius error: bf16 output rounding is 2^-9 per element


def parse_shape(text: str) -> tuple[int, int, int]:
  """ "8192" -> (8192, 8192, 8192); "32768x7168x4096" -> (32768, 7168, 4096) as M, K, N."""
  dims = [int(d) for d in text.split("x")]
  if len(dims) == 1:
    dims *= 3
  if len(dims) != 3 or min(dims) < CHECK_ROWS:
    raise ValueError(text)
  return tuple(dims)


def measure(m: int, k: int, n: int, iters: int) -> dict:
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(m + k), (m, k), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(k + n + 1), (k, n), jnp.bfloat16)
  gemm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  out = gemm(a, b)
  ref = jnp.dot(a[:CHECK_ROWS].astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  err = float(jnp.linalg.norm(out[:CHECK_ROWS].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
  ms, timer = jax_time_ms(gemm, (a, b), iters)
  return {
    "shape": f"{m}x{k}x{n}",
    "ms": ms,
    "tflops": 2.0 * m * k * n / ms / 1e9,
    "timer": timer,
    "rel_err": err,
    "ok": err < BOUND,
  }


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--shapes", default="8192,16384,32768x7168x4096")
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  try:
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
  except ValueError:
    ap.error(f"--shapes {args.shapes}: comma-separated N or MxKxN, each dimension at least {CHECK_ROWS}")
  import jax

  from MaxText.flops import peak_tflops

  rows = []
  for m, k, n in shapes:
    rows.append(measure(m, k, n, args.iters))
    r = rows[-1]
    print(f"bf16 {r['shape']}: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s ({r['timer']}), rel err {r['rel_err']:.2e}")
  kind = jax.devices()[0].device_kind
  best = max(r["tflops"] for r in rows if r["ok"]) if any(r["ok"] for r in rows) else None
  results = {
    "machine": machine.describe(),
    "rows": rows,
    "measured_peak_tflops": best,
    "published_tflops": peak_tflops(kind),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "dense_peak.json").write_text(json.dumps(results, indent=1))
  print(f"measured bf16 dense peak {best} TFLOP/s; published {results['published_tflops']} ({kind})")
  return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
