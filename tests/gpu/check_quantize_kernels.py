"""GPU check: fp8_blockwise's single-pass quantisation kernels (MaxText/kernels/triton_quantize.py, Triton)
against the format (formats.py as XLA runs it on the host CPU) bit for bit, and device times against the
jnp quantisation as XLA runs it on the GPU.

  python3 tests/gpu/check_quantize_kernels.py --out OUT.json

Inputs are random bf16 at DeepSeek-V3's expert widths with an all-zero, an Inf and a NaN block planted:
  weights      w [8, 7168, 4096] and [32, 2048, 7168]: q, q^T and the 128x128 block scales
  activations  x [32768, 7168] and dy [32768, 4096], 8 balanced groups and 32 skewed groups leaving a tail
               of rows outside every group: 1x128 tiles along K, and the aligned rows in 128x1 tiles,
               row-block-major (the wgrad operand)
and the wgrad operand requantised from fp8 rows through bf16 (columns_from_rows, quantize_before_permute).
On a slice of each input (one expert; 4,096 rows in two groups) every byte of every value and scale must
equal what XLA computes on the host CPU (NaNs as NaNs), which tests/test_quant.py checks against a NumPy
reference of the format. On the whole inputs the kernels are compared with XLA's GPU fusions of the same
jnp code, and the number of differing values is recorded (XLA:GPU is not bit-exact: see the results).
Times are CUPTI device times of all kernels each path launches, medians of 10. Exit code 1 if a kernel
output differs from the format, or a scale from XLA's.
"""

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.gmm import fp8_blockwise
from MaxText.kernels import triton_quantize
from MaxText.quant import formats
from MaxText.quant.groups import to_aligned

ROWS = 32768


def fused_rows(a, sizes, num_warps=None):
  """(rows_q, rows_scale, cols_q, cols_scale) from the kernel."""
  source = fp8_blockwise.align_all_rows(sizes, a.shape[0]).source
  return triton_quantize.quantize_rows_and_columns(a, source, num_warps=num_warps)


def xla_rows(a, sizes):
  """The same four arrays from the format in jnp."""
  aligned = fp8_blockwise.align_all_rows(sizes, a.shape[0])
  rows = formats.activation_quantize(a, 1)
  cols = formats.blockwise_quantize(to_aligned(a, aligned), {0: formats.FP8_BLOCK})
  return rows.q, rows.scale, fp8_blockwise.rows_block_major(cols.q), cols.scale


def fused_weight(w, num_warps=triton_quantize.WEIGHT_WARPS):
  q, scale, q_t = triton_quantize.weight_quantize_both(w, num_warps=num_warps)
  return q, q_t, scale


def xla_weight(w):
  wq = formats.weight_quantize(w)
  return wq.q, jnp.swapaxes(wq.q, 1, 2), wq.scale


def device_ms(fn, args) -> float:
  from jax.experimental.mosaic.gpu import profiler

  jax.block_until_ready(fn(*args))
  _, timings = profiler.measure(fn, aggregate=False, iterations=10)(*args)
  return statistics.median(sum(ms for _, ms in it) for it in timings)


def differing(a, b) -> int:
  """How many elements differ (NaN equals NaN); -1 for a different dtype or shape."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return -1
  af, bf = a.astype(np.float32), b.astype(np.float32)
  return int(np.sum(~((af == bf) | (np.isnan(af) & np.isnan(bf)))))


def fused_columns(q, scale, sizes, num_warps=triton_quantize.ACTIVATION_WARPS):
  """(cols_q, cols_scale) from the kernel."""
  source = fp8_blockwise.align_all_rows(sizes, q.shape[0]).source
  return triton_quantize.columns_from_rows(q, scale, source, jnp.bfloat16, num_warps=num_warps)


def xla_columns(q, scale, sizes):
  rows = formats.Quantized(q, scale, ((1, formats.FP8_BLOCK),))
  cols = fp8_blockwise.columns_from_rows(rows, fp8_blockwise.align_all_rows(sizes, q.shape[0]), jnp.bfloat16)
  return fp8_blockwise.rows_block_major(cols.q), cols.scale


def on_cpu(fn, *args):
  cpu = jax.devices("cpu")[0]
  return jax.jit(fn)(*jax.device_put(args, cpu))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument(
    "--num-warps",
    default="",
    help="comma-separated warp counts to time the kernels at too (defaults: triton_quantize.*_WARPS)",
  )
  args = ap.parse_args()
  try:
    sweep = [int(v) for v in args.num_warps.split(",") if v]
  except ValueError:
    ap.error(f"--num-warps {args.num_warps}: comma-separated integers, e.g. 4,16")
  seed = int.from_bytes(os.urandom(4), "little")
  rng = np.random.default_rng(seed)
  results, ok = {"seed": seed, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": []}, True

  def record(row, names, got, xla_gpu, got_slice, cpu_slice, xla_gpu_slice):
    """Kernel outputs against the format (CPU) on the slice, must be 0; against XLA:GPU, counted."""
    nonlocal ok
    row["differ_from_format"] = {n: differing(a, b) for n, a, b in zip(names, got_slice, cpu_slice)}
    row["differ_from_xla_gpu"] = {n: differing(a, b) for n, a, b in zip(names, got, xla_gpu)}
    row["xla_gpu_differs_from_format"] = {n: differing(a, b) for n, a, b in zip(names, xla_gpu_slice, cpu_slice)}
    row["elements"] = {n: int(np.size(a)) for n, a in zip(names, got)}
    row["speedup"] = row["xla_ms"] / row["fused_ms"]
    fused, fused_args = row.pop("_fused"), row.pop("_args")
    if sweep:
      row["fused_ms_by_num_warps"] = {
        nw: device_ms(jax.jit(functools.partial(fused, num_warps=nw)), fused_args) for nw in sweep
      }
    ok &= all(v == 0 for v in row["differ_from_format"].values())
    ok &= all(v == 0 for n, v in row["differ_from_xla_gpu"].items() if "scale" in n)
    results["cases"].append(row)
    print(json.dumps(row), flush=True)

  for g, k, n in ((8, 7168, 4096), (32, 2048, 7168)):
    w = jnp.asarray(rng.standard_normal((g, k, n), np.float32) * 0.02, jnp.bfloat16)
    w = w.at[1, 256:384, 128:256].set(0).at[0, 5, 4000].set(jnp.inf).at[g - 1, 1000, 77].set(jnp.nan)
    w1 = w[:1] if g == 8 else w[g - 1 :]  # the expert holding the Inf, or the NaN
    row = {
      "tensor": "weight",
      "shape": [g, k, n],
      "fused_ms": device_ms(jax.jit(fused_weight), (w,)),
      "xla_ms": device_ms(jax.jit(xla_weight), (w,)),
      "_fused": fused_weight,
      "_args": (w,),
    }
    record(
      row,
      ("q", "q_t", "scale"),
      jax.jit(fused_weight)(w),
      jax.jit(xla_weight)(w),
      jax.jit(fused_weight)(w1),
      on_cpu(xla_weight, w1),
      jax.jit(xla_weight)(w1),
    )

  skewed = np.floor(rng.dirichlet(np.full(32, 0.5)) * (ROWS - 1000) / 16).astype(np.int32) * 16
  cases = {"balanced_g8": np.full(8, ROWS // 8, np.int32), "skewed_g32_tail": skewed}
  for width in (7168, 4096):
    x = jnp.asarray(rng.standard_normal((ROWS, width), np.float32) * 2, jnp.bfloat16)
    x = x.at[1000:1128, 256:384].set(0).at[77, 5].set(jnp.inf).at[30000, 4000].set(jnp.nan)
    for name, sizes_np in cases.items():
      sizes = jnp.asarray(sizes_np)
      names = ("rows_q", "rows_scale", "cols_q", "cols_scale")
      # The slice: 4,096 rows (the zero tile, the Inf) in two groups, the last 96 outside both.
      xs, ss = x[:4096], jnp.asarray([2000, 2000], jnp.int32)
      row = {
        "tensor": "activation",
        "shape": [ROWS, width],
        "groups": name,
        "rows_in_groups": int(sizes_np.sum()),
        "fused_ms": device_ms(jax.jit(fused_rows), (x, sizes)),
        "xla_ms": device_ms(jax.jit(xla_rows), (x, sizes)),
        "_fused": fused_rows,
        "_args": (x, sizes),
      }
      record(
        row,
        names,
        jax.jit(fused_rows)(x, sizes),
        jax.jit(xla_rows)(x, sizes),
        jax.jit(fused_rows)(xs, ss),
        on_cpu(xla_rows, xs, ss),
        jax.jit(xla_rows)(xs, ss),
      )
      # The wgrad operand from the fp8 rows, as the layer's backward makes it under quantize_before_permute.
      rq = jax.jit(lambda a: formats.activation_quantize(a, 1))(x)
      rqs = (rq.q[:4096], rq.scale[:4096])
      row = {
        "tensor": "columns_from_fp8_rows",
        "shape": [ROWS, width],
        "groups": name,
        "rows_in_groups": int(sizes_np.sum()),
        "fused_ms": device_ms(jax.jit(fused_columns), (rq.q, rq.scale, sizes)),
        "xla_ms": device_ms(jax.jit(xla_columns), (rq.q, rq.scale, sizes)),
        "_fused": fused_columns,
        "_args": (rq.q, rq.scale, sizes),
      }
      record(
        row,
        ("cols_q", "cols_scale"),
        jax.jit(fused_columns)(rq.q, rq.scale, sizes),
        jax.jit(xla_columns)(rq.q, rq.scale, sizes),
        jax.jit(fused_columns)(*rqs, ss),
        on_cpu(xla_columns, *rqs, ss),
        jax.jit(xla_columns)(*rqs, ss),
      )
  results["passed"] = ok
  args.out.write_text(json.dumps(results, indent=1))
  print("PASS" if ok else "FAIL")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
