"""The GPU's measured bf16 dense GEMM rate: the peak that MFU "of the measured peak" divides by.

  python3 benchmarks/dense_peak.py --out DIR [--sizes 4096,8192,16384] [--iters 20]

Square bf16 GEMMs with fp32 accumulation (XLA's cuBLAS call, jnp.dot with preferred_element_type float32,
bf16 output) on random normal inputs, timed by device kernel time (CUPTI, Mosaic GPU's profiler; host
wall time if CUPTI is unavailable, said in the results) after warm-up, median over iterations. The output
is checked against a float32 product of the same bf16 inputs on a sample of rows, so a wrong or skipped
GEMM cannot pass as fast. The published peak (MaxText/flops.py) is printed beside it. Writes
DIR/dense_peak.json.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouped_gemm import jax_time_ms, machine  # noqa: E402

CHECK_ROWS = 64  # rows compared with the float32 product (the whole product in fp32 would double the memory)
BOUND = 1e-2  # relative Frobenius error: bf16 output rounding is 2^-9 per element


def measure(n: int, iters: int) -> dict:
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(n), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(n + 1), (n, n), jnp.bfloat16)
  gemm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  out = gemm(a, b)
  ref = jnp.dot(a[:CHECK_ROWS].astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  err = float(jnp.linalg.norm(out[:CHECK_ROWS].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
  ms, timer = jax_time_ms(gemm, (a, b), iters)
  return {"n": n, "ms": ms, "tflops": 2.0 * n**3 / ms / 1e9, "timer": timer, "rel_err": err, "ok": err < BOUND}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--sizes", default="4096,8192,16384")
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  try:
    sizes = [int(s) for s in args.sizes.split(",")]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < CHECK_ROWS:
    ap.error(f"--sizes {args.sizes}: comma-separated matrix sizes of at least {CHECK_ROWS}")
  import jax

  from MaxText.flops import peak_tflops

  rows = []
  for n in sizes:
    rows.append(measure(n, args.iters))
    r = rows[-1]
    print(f"bf16 {n}^3: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s ({r['timer']}), rel err {r['rel_err']:.2e}")
  kind = jax.devices()[0].device_kind
  best = max(r["tflops"] for r in rows if r["ok"]) if any(r["ok"] for r in rows) else None
  results = {"machine": machine(), "rows": rows, "measured_peak_tflops": best, "published_tflops": peak_tflops(kind)}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "dense_peak.json").write_text(json.dumps(results, indent=1))
  print(f"measured bf16 dense peak {best} TFLOP/s; published {results['published_tflops']} ({kind})")
  return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
