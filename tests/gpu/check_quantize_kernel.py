"""GPU check: fp8_blockwise's fused activation quantisation (MaxText/quant/quantize_kernel.py, a Triton
kernel) against the jnp quantisation XLA runs (formats.py), bit for bit, and the device time of each.

  python3 tests/gpu/check_quantize_kernel.py --out OUT.json

For DeepSeek-V3's expert widths (x [32768, 7168] and dy [32768, 4096]; 8 balanced groups, and 32 skewed
groups that leave a tail of rows outside every group), on random bf16 inputs with an all-zero, an Inf
and a NaN tile planted, the kernel's two outputs (1x128 tiles along K; aligned rows in 128x1 tiles,
row-block-major) must equal XLA's, every byte of every scale and value (NaNs as NaNs). Times are CUPTI
device times of all kernels each path launches (medians of 10). Exit code 1 if any output differs.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.quant import fp8_blockwise, formats, quantize_kernel
from MaxText.quant.groups import to_aligned

ROWS = 32768


def fused(a, sizes):
  return quantize_kernel.quantize_rows_and_columns(a, fp8_blockwise.align_all_rows(sizes, a.shape[0]))


def unfused(a, sizes):
  aligned = fp8_blockwise.align_all_rows(sizes, a.shape[0])
  cols = formats.blockwise_quantize(to_aligned(a, aligned), {0: formats.FP8_BLOCK})
  blocks = aligned.padded_rows // formats.FP8_BLOCK
  q = cols.q.reshape(blocks, formats.FP8_BLOCK, a.shape[1]).transpose(0, 2, 1)  # the layout wgrad reads
  return formats.activation_quantize(a, 1), formats.Quantized(q, cols.scale, cols.blocks)


def device_ms(fn, args) -> float:
  from jax.experimental.mosaic.gpu import profiler

  jax.block_until_ready(fn(*args))
  _, timings = profiler.measure(fn, aggregate=False, iterations=10)(*args)
  return statistics.median(sum(ms for _, ms in it) for it in timings)


def same_bits(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return False
  af, bf = a.astype(np.float32), b.astype(np.float32)
  return bool(np.array_equal(af, bf, equal_nan=True) and np.array_equal(np.isnan(af), np.isnan(bf)))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path, required=True)
  args = ap.parse_args()
  seed = int.from_bytes(os.urandom(4), "little")
  rng = np.random.default_rng(seed)
  skewed = np.floor(rng.dirichlet(np.full(32, 0.5)) * (ROWS - 1000) / 16).astype(np.int32) * 16
  cases = {"balanced_g8": np.full(8, ROWS // 8, np.int32), "skewed_g32_tail": skewed}
  results, ok = {"seed": seed, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": []}, True
  for width in (7168, 4096):
    x = jnp.asarray(rng.standard_normal((ROWS, width), np.float32) * 2, jnp.bfloat16)
    x = x.at[1000:1128, 256:384].set(0).at[77, 5].set(jnp.inf).at[30000, 4000].set(jnp.nan)
    for name, sizes_np in cases.items():
      sizes = jnp.asarray(sizes_np)
      f_fused, f_unfused = jax.jit(fused), jax.jit(unfused)
      (gr, gc), (wr, wc) = f_fused(x, sizes), f_unfused(x, sizes)
      checks = {"rows_q": same_bits(gr.q, wr.q), "rows_scale": same_bits(gr.scale, wr.scale),
                "cols_q": same_bits(gc.q, wc.q), "cols_scale": same_bits(gc.scale, wc.scale)}
      row = {"rows": ROWS, "width": width, "groups": name, "rows_in_groups": int(sizes_np.sum()), **checks,
             "fused_ms": device_ms(f_fused, (x, sizes)), "xla_ms": device_ms(f_unfused, (x, sizes))}
      row["speedup"] = row["xla_ms"] / row["fused_ms"]
      ok &= all(checks.values())
      results["cases"].append(row)
      print(json.dumps(row), flush=True)
  results["passed"] = ok
  args.out.write_text(json.dumps(results, indent=1))
  print("PASS" if ok else "FAIL")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
