"""GPU check: the quantised expert GEMMs (MaxText/gmm/'s registry) against float references, forward, dgrad and
wgrad.

  python3 tests/gpu/check_fp8_gmm.py --out OUT.json          # on the GPU (fp8_blockwise Mosaic kernels need sm_90)
  python3 tests/gpu/check_fp8_gmm.py --out OUT.json --cpu-dry-run   # tiny shapes on CPU, Pallas' GPU interpreter

For each case (DeepSeek-V3 widths with balanced and skewed groups, empty groups, all rows in one group,
group and width sizes that are not multiples of 128) and each quantised entry of the registry that can run
here (fp8_blockwise:mosaic, our Hopper kernels; fp8_blockwise:xla; mxfp8 emulated on each bf16 backend;
mxfp8:block_scaled, jax.lax.scaled_dot per window; --gemms to choose), on fresh random inputs (seed from
os.urandom, recorded), with freed device memory filled with NaN before each run:

  exact    each output against the float32 product of the dequantised operands (quantised along that
           GEMM's contraction; rows per group for wgrad), computed on the host: the kernel must equal it
           up to fp32 accumulation and the bf16 output rounding (2^-9 relative per element), so the
           relative Frobenius error bound is 1e-2. A wrong scale, block or group boundary is off by O(1).
  format   against the unquantised float32 product: e4m3's 3 mantissa bits give ~3.5% relative Frobenius
           error for a product of two quantised random operands; bound 0.06.

Outputs must be finite. In --cpu-dry-run the Hopper-only entries run where they take Pallas' GPU interpreter
(fp8_blockwise:mosaic); the others (mxfp8:mosaic's bf16 kernels) are skipped, and said so. Writes OUT.json
and OUT.md; exit code 1 if any check fails.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gmm import CASES, inputs, outcome, rel, run  # noqa: E402

from MaxText import gmm  # noqa: E402
from MaxText.quant import formats, groups  # noqa: E402

EXACT_BOUND = 1e-2
FORMAT_BOUND = 0.06


def dequantized_operands(fmt, x, w, dy, sizes):
  """Each GEMM's operands through entry `fmt`'s format, dequantised to float32, on the host."""
  if gmm.EXPERT_GEMMS[fmt].quantization == "mxfp8":
    deq = lambda a, axis: formats.dequantize(formats.mx_quantize(a, axis))  # noqa: E731
    xk, wk, dyn, wn = deq(x, 1), deq(w, 1), deq(dy, 1), deq(w, 2)
    block, rows = formats.MX_BLOCK, lambda a: deq(a, 0)  # noqa: E731
  else:
    xk, dyn = (formats.dequantize(formats.activation_quantize(a, 1)) for a in (x, dy))
    wk = wn = formats.dequantize(formats.weight_quantize(w))
    block, rows = formats.FP8_BLOCK, lambda a: formats.dequantize(formats.blockwise_quantize(a, {0: formats.FP8_BLOCK}))  # noqa: E731
  aligned = groups.align_groups(sizes, x.shape[0], block)
  xr, dyr = (groups.from_aligned(rows(groups.to_aligned(a, aligned)), aligned) for a in (x, dy))
  return [np.asarray(a, np.float32) for a in (xk, wk, dyn, wn, xr, dyr)]


def host_products(a_fwd, w_fwd, a_bwd, w_bwd, x_rows, dy_rows, sizes):
  """y = a_fwd @ w_fwd[g], dx = a_bwd @ w_bwd[g]^T, dw[g] = x_rows_g^T @ dy_rows_g, group by group in float32."""
  ends = np.cumsum(sizes)
  y = np.zeros((a_fwd.shape[0], w_fwd.shape[2]), np.float32)
  dx = np.zeros((a_bwd.shape[0], w_bwd.shape[1]), np.float32)
  dw = np.zeros(w_fwd.shape, np.float32)
  for g, (start, end) in enumerate(zip(ends - sizes, ends)):
    y[start:end] = a_fwd[start:end] @ w_fwd[g]
    dx[start:end] = a_bwd[start:end] @ w_bwd[g].T
    dw[g] = x_rows[start:end].T @ dy_rows[start:end]
  return y, dx, dw


def compare(outs, refs, valid, bound) -> dict:
  names = ("y", "dx", "dw")
  errs = {
    k: rel(np.asarray(o.astype(jnp.float32))[: valid if k != "dw" else None], r[: valid if k != "dw" else None])
    for k, o, r in zip(names, outs, refs)
  }
  return {"rel_err": errs, "pass": max(errs.values()) < bound}


def check(fmt, fn, x, w, dy, sizes_np, sizes, unquantised) -> dict:
  """fmt's outputs on one case: finite, and within the bounds of the dequantised and the unquantised products."""
  valid = int(sizes_np.sum())
  outs = run(fn, x, w, sizes, dy)
  finite = all(bool(jnp.all(jnp.isfinite(o[:valid] if o.ndim == 2 else o))) for o in outs)
  exact = compare(outs, host_products(*dequantized_operands(fmt, x, w, dy, sizes), sizes_np), valid, EXACT_BOUND)
  fmt_err = compare(outs, unquantised, valid, FORMAT_BOUND)
  return {"finite": finite, "exact": exact, "format": fmt_err, "pass": finite and exact["pass"] and fmt_err["pass"]}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path, required=True, help="JSON results path (a .md table is written beside it)")
  ap.add_argument(
    "--cpu-dry-run",
    action="store_true",
    help="tiny shapes in float32; fp8_blockwise's Hopper kernels in the Mosaic GPU interpreter",
  )
  ap.add_argument(
    "--gemms",
    default="",
    help="comma-separated quantised expert GEMMs (registry names) to check (default: every one that can run here)",
  )
  ap.add_argument(
    "--quick",
    action="store_true",
    help="three cases (DeepSeek-V3 widths balanced and skewed, odd sizes and widths) instead of all",
  )
  ap.add_argument("--no-mxfp8", action="store_true", help="check only the fp8_blockwise entries")
  ap.add_argument(
    "--cases", default="", help="comma-separated indices into check_gmm.CASES to run (default: all; splits the check)"
  )
  args = ap.parse_args()
  picked = [int(i) for i in args.cases.split(",") if i.strip()]
  if bad := [i for i in picked if not 0 <= i < len(CASES)]:
    ap.error(f"--cases {','.join(map(str, bad))}: indices run from 0 to {len(CASES) - 1}")
  quantised = [n for n, e in gmm.EXPERT_GEMMS.items() if e.quantization]
  names = [n for n in args.gemms.split(",") if n] or quantised
  if unknown := [n for n in names if n not in quantised]:
    ap.error(f"--gemms {','.join(unknown)}: choose from {', '.join(quantised)}")
  if args.no_mxfp8:
    names = [n for n in names if gmm.EXPERT_GEMMS[n].quantization != "mxfp8"]
  seed = int.from_bytes(os.urandom(4), "little")
  rng = np.random.default_rng(seed)
  device = jax.devices()[0]
  if args.cpu_dry_run:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    options = gmm.Options(interpret=plgpu.InterpretGPUParams())
    cases = [("small", 300, 256, 136, 4, "odd_sizes"), ("small", 256, 200, 256, 3, "one_group")]
  else:
    options = gmm.Options()
    cases = [CASES[i] for i in picked] if picked else [CASES[0], CASES[2], CASES[-1]] if args.quick else CASES
  impls, skipped = {}, {}
  for name in names:
    if problem := gmm.unavailable(name) or gmm.not_runnable_on(name, device):
      skipped[name] = problem
      continue
    impls[name] = gmm.build(name, options)
    # Off the GPU a Hopper-only entry runs only where its kernels take the interpreter (Options.interpret).
    if gmm.EXPERT_GEMMS[name].hopper_only and device.platform != "gpu":
      if not getattr(getattr(impls[name], "kernels", None), "interpret", False):
        skipped[name] = "its Hopper kernels take no GPU interpreter"
        del impls[name]
  print("skipped:", skipped, flush=True)
  dtype = jnp.float32 if args.cpu_dry_run else jnp.bfloat16
  results = {
    "seed": seed,
    "device": jax.devices()[0].device_kind,
    "exact_bound": EXACT_BOUND,
    "format_bound": FORMAT_BOUND,
    "skipped": skipped,
    "cases": [],
  }
  ok = True
  args.out.parent.mkdir(parents=True, exist_ok=True)
  save = lambda r: args.out.write_text(json.dumps(r, indent=1))  # noqa: E731
  for label, m, k, n, g, kind in cases:
    sizes_np, x, w, dy, sizes = inputs(m, k, n, g, kind, rng, dtype)
    plain = [np.asarray(a.astype(jnp.float32)) for a in (x, w, dy)]
    unquantised = host_products(plain[0], plain[1], plain[2], plain[1], plain[0], plain[2], sizes_np)
    entry = {"case": label, "m": m, "k": k, "n": n, "groups": g, "sizes": kind, "quant": {}}
    for fmt, fn in impls.items():
      entry["quant"][fmt] = outcome(lambda: check(fmt, fn, x, w, dy, sizes_np, sizes, unquantised), label, kind, g, fmt)
      ok &= entry["quant"][fmt]["pass"]
    results["cases"].append(entry)
    save(results)  # after each case: partial results survive a timeout
  results["all_pass"] = ok
  save(results)
  args.out.with_suffix(".md").write_text(markdown(results))
  print(markdown(results))
  return 0 if ok else 1


def markdown(results: dict) -> str:
  lines = [
    f"# Quantised grouped GEMM check ({results['device']}, seed {results['seed']})",
    "",
    f"Relative Frobenius errors: exact = vs the product of the dequantised operands (bound {results['exact_bound']}); "
    f"format = vs the unquantised product (bound {results['format_bound']}).",
    "",
    "| case | M | K | N | G | sizes | quant | y exact | dx exact | dw exact | y format | dx format | dw format "
    "| pass |",
    "|---" * 14 + "|",
  ]
  for c in results["cases"]:
    for fmt, r in c["quant"].items():
      cells = [
        f"{r[kind]['rel_err'][o]:.2e}" if kind in r else "-" for kind in ("exact", "format") for o in ("y", "dx", "dw")
      ]
      lines.append(
        f"| {c['case']} | {c['m']} | {c['k']} | {c['n']} | {c['groups']} | {c['sizes']} | {fmt} | "
        + " | ".join(cells)
        + f" | {r['pass']} |"
      )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
