"""Grouped-GEMM benchmark at DeepSeek-V3 expert shapes: every backend side by side, in one run.

  python benchmarks/grouped_gemm.py --out DIR [--tune] [--quick]
  python benchmarks/grouped_gemm.py --plot DIR/grouped_gemm.json      # bar chart PNG (needs matplotlib)
  python benchmarks/grouped_gemm.py --out DIR --quick --quant fp8_blockwise,mxfp8,mxfp8:block_scaled   # + quantised rows

Shapes: gate+up (K=7168 -> N=4096) and down (K=2048 -> N=7168), M=32768 token rows, G in {4, 8, 32}
groups, balanced and skewed (Dirichlet(0.5), seed 0) group sizes rounded to multiples of 16 (what
torch._grouped_mm needs). Rows: each available backend (xla, mosaic, padded, tokamax, te), the dense
GEMM of the same FLOPs, and torch._grouped_mm when a CUDA torch is importable; forward and
forward+backward (dx and dw). JAX timings are device kernel time from CUPTI (Mosaic GPU's profiler),
torch's from CUDA events; both after warm-up, median of repeats. TFLOP/s count useful FLOPs only
(2MKN forward, 6MKN forward+backward), so padding shows up as lost throughput.

--tune first searches Mosaic tile parameters for each kernel and width pair at --tune-groups
balanced groups, merges them into a copy of the current table as that group-count regime, writes
mosaic_tiles.json into DIR (copy it to MaxText/moe/gmm/ to make it the tuned table) and benchmarks
with it (--tune-only: stop after tuning).
"""

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

M = 32768
SHAPES = {"gate_up": (7168, 4096), "down": (2048, 7168)}
CASES = [(4, "balanced"), (4, "skewed"), (8, "balanced"), (32, "balanced"), (32, "skewed")]


def group_sizes(m: int, g: int, kind: str) -> np.ndarray:
  if kind == "balanced":
    sizes = np.full(g, m // g)
  else:
    sizes = np.floor(np.random.default_rng(0).dirichlet(np.full(g, 0.5)) * m / 16).astype(int) * 16
  sizes[int(np.argmax(sizes))] += m - sizes.sum()
  return sizes.astype(np.int32)


def parse_cases(ap: argparse.ArgumentParser, text: str) -> list[tuple[int, str]]:
  """--cases "32:balanced,8:skewed" -> [(32, "balanced"), (8, "skewed")] (gmm_profile.py's too)."""
  try:
    cases = [(int(g), kind) for g, kind in (c.split(":") for c in text.split(","))]
  except ValueError:
    cases = []
  if not cases or any(g < 1 or kind not in ("balanced", "skewed") for g, kind in cases):
    ap.error(f"--cases {text}: each case is GROUPS:balanced or GROUPS:skewed, comma-separated")
  return cases


# ---- timing ----
def jax_time_ms(fn, args, iters: int) -> tuple[float, str]:
  """Median device time per call: CUPTI kernel time on a GPU when available, else host wall time per call."""
  import jax

  jax.block_until_ready(fn(*args))  # compile + warm-up
  jax.block_until_ready(fn(*args))
  if jax.devices()[0].platform == "gpu":  # moe_layer.py --small times on the CPU
    try:
      from jax.experimental.mosaic.gpu import profiler

      _, times = profiler.measure(fn, iterations=iters)(*args)
      if times:
        return statistics.median(times), "cupti"
    except Exception as e:  # CUPTI can be unavailable in containers; say so in the results
      print(f"CUPTI unavailable ({type(e).__name__}: {e}); timing on the host", flush=True)
  samples = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - start) * 1e3)
  return statistics.median(samples), "host"


def torch_time_ms(fn, iters: int) -> float:
  import torch

  for _ in range(3):
    fn()
  torch.cuda.synchronize()
  samples = []
  for _ in range(iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(end))
  return statistics.median(samples)


# ---- JAX rows ----
def jax_inputs(k: int, n: int, g: int, kind: str) -> tuple:
  """One case's bf16 inputs from key 0 (gmm_profile.py's too): (host group sizes, x, w, dy, device group sizes)."""
  import jax
  import jax.numpy as jnp

  sizes_np = group_sizes(M, g, kind)
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (M, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[2], (M, n), jnp.bfloat16)
  return sizes_np, x, w, dy, jnp.asarray(sizes_np)


def jax_rows(
  k: int, n: int, g: int, kind: str, iters: int, quant: tuple[str, ...] = (), fp8_tiles: tuple[str, ...] = ()
) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from MaxText.moe import gmm as registry

  sizes_np, x, w, dy, sizes = jax_inputs(k, n, g, kind)
  flops = 2.0 * M * k * n
  rows = []

  def add(backend, fwd, fwd_bwd, args, extra=None):
    for mode, fn, mult in (("fwd", fwd, 1), ("fwd+bwd", fwd_bwd, 3)):
      try:
        ms, timer = jax_time_ms(jax.jit(fn), args, iters)
        rows.append(
          {
            "backend": backend,
            "mode": mode,
            "ms": ms,
            "tflops": mult * flops / ms / 1e9,
            "timer": timer,
            **(extra or {}),
          }
        )
      except Exception as e:
        rows.append({"backend": backend, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:200]}"})
      print(k, n, g, kind, rows[-1], flush=True)

  def grad_fn(f):
    def run(x, w, dy):
      y, vjp = jax.vjp(f, x, w)
      return y, *vjp(dy)

    return run

  for name in ("xla", "mosaic", "tokamax", "te"):
    if registry.available(name):
      f = registry.get_gmm(name)
      add(name, lambda x, w, dy, f=f: f(x, w, sizes), grad_fn(lambda x, w, f=f: f(x, w, sizes)), (x, w, dy))
  if registry.available("mosaic"):
    from MaxText.moe.gmm import mosaic

    # The kernel set the backend does not use by default, side by side ("mosaic:ours" / "mosaic:jax").
    for kernels in mosaic.KERNELS:
      if kernels != mosaic.DEFAULT_KERNELS:
        f = mosaic.make_gmm(kernels)
        add(
          f"mosaic:{kernels}",
          lambda x, w, dy, f=f: f(x, w, sizes),
          grad_fn(lambda x, w, f=f: f(x, w, sizes)),
          (x, w, dy),
        )
    # --quant: the quantised expert GEMMs (MaxText/quant/), quantisation passes included in the time.
    from MaxText.quant import labelled_gmm

    for q in quant:  # quant.labels(): NAME, fp8_blockwise:VARIANT, mxfp8:IMPL
      f = labelled_gmm(q, jax.devices()[0])
      add(f"mosaic+{q}", lambda x, w, dy, f=f: f(x, w, sizes), grad_fn(lambda x, w, f=f: f(x, w, sizes)), (x, w, dy))
    from MaxText.quant import fp8_blockwise

    for tiles in fp8_tiles:  # MxNxSTAGESxGRIDN; suffix "ws": warp-specialized, "wsb": and the weights' block scales
      options = {"ws": {"warp_specialized": True}, "wsb": {"warp_specialized": True, "b_block_scales": True}}.get(
        tiles.lstrip("0123456789x"), {}
      )
      f = fp8_blockwise.make_gmm(fp8_blockwise.MosaicKernels(*map(int, tiles.rstrip("wsb").split("x")), **options))
      add(
        f"mosaic+fp8_blockwise[{tiles}]",
        lambda x, w, dy, f=f: f(x, w, sizes),
        grad_fn(lambda x, w, f=f: f(x, w, sizes)),
        (x, w, dy),
      )

  # Fixed capacity: every group padded to the largest group (rounded to 128 rows).
  cap = int(-(-sizes_np.max() // 128) * 128)
  starts = np.concatenate([[0], np.cumsum(sizes_np)[:-1]])
  index = np.full((g, cap), M, np.int32)  # M -> a zero row
  for e in range(g):
    index[e, : sizes_np[e]] = starts[e] + np.arange(sizes_np[e])
  index = jnp.asarray(index)

  def padded(x, w):
    xp = jnp.take(jnp.concatenate([x, jnp.zeros((1, k), x.dtype)]), index, axis=0)
    return jnp.einsum("gck,gkn->gcn", xp, w, preferred_element_type=x.dtype)

  pad_factor = g * cap / M
  dyp = jnp.zeros((g, cap, n), jnp.bfloat16)
  add("padded", lambda x, w, dy: padded(x, w), grad_fn(padded), (x, w, dyp), extra={"pad_factor": pad_factor})

  w0 = w[0]
  add("dense", lambda x, w, dy: x @ w, grad_fn(lambda x, w: x @ w), (x, w0, dy))
  return rows


# ---- torch rows ----
def torch_rows(k: int, n: int, g: int, kind: str, iters: int) -> list[dict]:
  try:
    import torch
  except ImportError:
    return []
  if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
    return []
  sizes = group_sizes(M, g, kind)
  offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
  x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
  w = (torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_(True)
  dy = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
  flops = 2.0 * M * k * n
  rows = []
  try:
    with torch.no_grad():
      fwd_ms = torch_time_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), iters)

    def fwd_bwd():
      torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(dy)

    both_ms = torch_time_ms(fwd_bwd, iters)
    rows.append(
      {
        "backend": "torch._grouped_mm",
        "mode": "fwd",
        "ms": fwd_ms,
        "tflops": flops / fwd_ms / 1e9,
        "timer": "cuda_events",
      }
    )
    rows.append(
      {
        "backend": "torch._grouped_mm",
        "mode": "fwd+bwd",
        "ms": both_ms,
        "tflops": 3 * flops / both_ms / 1e9,
        "timer": "cuda_events",
      }
    )
  except Exception as e:
    rows.append({"backend": "torch._grouped_mm", "mode": "fwd", "error": f"{type(e).__name__}: {str(e)[:200]}"})
  for r in rows:
    print(k, n, g, kind, r, flush=True)
  return rows


# ---- tuning ----
def tune(out_dir: Path, iters: int, kernels: str, groups: int) -> dict:
  """Searches tiles for each kernel of `kernels` and width pair at `groups` balanced groups.

  Results merge into a copy of the current table under "<kernel>:<K>x<N>:g<groups>" keys (used by
  mosaic.tiles_for for that group-count regime), written to out_dir/mosaic_tiles.json.
  """
  import jax
  import jax.numpy as jnp

  from MaxText.moe.gmm import mosaic

  ragged, transposed = mosaic.KERNELS[kernels]()
  sizes = jnp.asarray(group_sizes(M, groups, "balanced"))
  fwd_space = [(128, 128, 64, st, gb) for st, gb in itertools.product((4, 5, 6), (2, 4, 8, 16))]
  wgrad_space = [(128, 128, bk, st, gb) for bk, st, gb in itertools.product((64, 128), (2, 3, 4), (1, 4, 8))]
  if kernels in mosaic.WARP_SPECIALIZED:  # two consumer warpgroups share each tile: fewer, larger stages fit
    fwd_space = [(128, 128, 64, st, gb) for st, gb in itertools.product((2, 3), (2, 4, 8, 16))]
    wgrad_space = [
      (bm, bn, 64, st, gb) for (bm, bn), st, gb in itertools.product(((128, 128), (64, 256)), (2, 3), (1, 4, 8))
    ]
  table = json.loads(mosaic.TILES_FILE.read_text()) if mosaic.TILES_FILE.exists() else {"tiles": {}}
  measured = table.setdefault("tflops_by_tiles", {})
  for (k, n), kernel in itertools.product(SHAPES.values(), ("fwd", "dgrad", "wgrad")):
    # Widths as the kernel sees them: fwd contracts k into n; dgrad contracts n into k; wgrad (k, n).
    name = mosaic.tile_kernel(kernels, kernel)
    key = (f"{name}:{k}x{n}" if kernel != "dgrad" else f"{name}:{n}x{k}") + f":g{groups}"
    x = jax.random.normal(jax.random.key(1), (M, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (groups, k, n), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(3), (M, n), jnp.bfloat16)
    results = {}
    for tiles in wgrad_space if kernel == "wgrad" else fwd_space:
      kw = dict(zip(mosaic.TILE_NAMES, tiles))
      out_width = n if kernel in ("fwd", "wgrad") else k
      cta_n = kw["block_n"] * (2 if kernels in mosaic.WARP_SPECIALIZED and kernel != "wgrad" else 1)
      if out_width % (cta_n * (kw["grid_block_n"] if kernel != "wgrad" else 1)):
        continue
      if kernel == "fwd":
        fn, args = (lambda x, w, kw=kw: ragged(x, w, group_sizes=sizes, **kw)), (x, w)
      elif kernel == "dgrad":
        fn, args = (lambda dy, w, kw=kw: ragged(dy, w, group_sizes=sizes, transpose_rhs=True, **kw)), (dy, w)
      else:
        fn, args = (lambda x, dy, kw=kw: transposed(x, dy, group_sizes=sizes, **kw)), (x, dy)
      try:
        ms, _ = jax_time_ms(jax.jit(fn), args, iters)
        results[str(tiles)] = 2.0 * M * k * n / ms / 1e9
      except Exception as e:
        results[str(tiles)] = f"{type(e).__name__}: {str(e)[:120]}"
    valid = {t: v for t, v in results.items() if isinstance(v, float)}
    if valid:
      top = max(valid, key=valid.get)
      table["tiles"][key] = list(json.loads(top.replace("(", "[").replace(")", "]")))
      print(f"tuned {key}: {table['tiles'][key]} at {valid[top]:.0f} TFLOP/s", flush=True)
    measured[key] = results
  table.update({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": M})
  tuned = table.setdefault("kernels", {})  # which kernel sets hold tuned tiles, per group-count regime
  before = tuned.get(f"g{groups}", [])
  tuned[f"g{groups}"] = sorted({*([before] if isinstance(before, str) else before), kernels})
  path = out_dir / "mosaic_tiles.json"
  path.write_text(json.dumps(table, indent=1))
  mosaic.TILES_FILE = path
  mosaic.tuned_tiles.cache_clear()
  return table


# ---- report ----
def machine() -> dict:
  import jax
  import jaxlib

  info = {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "device": jax.devices()[0].device_kind,
    "date": time.strftime("%Y-%m-%d"),
  }
  try:
    info["gpu"] = subprocess.run(
      ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
  except OSError:
    info["gpu"] = None
  try:
    import torch

    info["torch"] = torch.__version__
  except ImportError:
    info["torch"] = None
  return info


def markdown(results: dict) -> str:
  m = results["machine"]
  leads = [b for b in results["backends"] if b.startswith("mosaic")]
  others = ("torch._grouped_mm", "dense", "xla")
  ratio_names = [f"{lead}/{o.split('.')[-1]}" for lead in leads for o in others]
  lines = [
    f"# Grouped GEMM, M={M} rows, bf16 ({m['gpu']}; jax {m['jax']}, torch {m.get('torch')}, {m['date']})",
    "",
    "TFLOP/s of useful work (padding counts as lost time). Ratios: each mosaic row over the named row.",
    "",
    "| shape | G | sizes | mode | " + " | ".join(results["backends"] + ratio_names) + " |",
    "|---" * (4 + len(results["backends"]) + len(ratio_names)) + "|",
  ]
  for case in results["cases"]:
    for mode in ("fwd", "fwd+bwd"):
      by = {r["backend"]: r for r in case["rows"] if r["mode"] == mode}
      cells = [f"{by[b]['tflops']:.0f}" if "tflops" in by.get(b, {}) else "-" for b in results["backends"]]
      ratio = lambda a, b: (
        f"{by[a]['tflops'] / by[b]['tflops']:.2f}" if "tflops" in by.get(a, {}) and "tflops" in by.get(b, {}) else "-"
      )  # noqa: E731
      cells += [ratio(lead, o) for lead in leads for o in others]
      lines.append(f"| {case['shape']} | {case['groups']} | {case['sizes']} | {mode} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def quant_summary(results: dict) -> str:
  """--quant rows against bf16 mosaic, fwd+bwd (issue 7's target: fp8_blockwise >= 1.4x)."""
  quant = [b for b in results["backends"] if b.startswith("mosaic+")]
  if not quant:
    return ""
  lines = [
    "",
    "Quantised over bf16 `mosaic`, speed-up (TFLOP/s ratio):",
    "",
    "| shape | G | sizes | mode | " + " | ".join(quant) + " |",
    "|---" * (4 + len(quant)) + "|",
  ]
  for case in results["cases"]:
    for mode in ("fwd", "fwd+bwd"):
      by = {r["backend"]: r.get("tflops") for r in case["rows"] if r["mode"] == mode}
      cells = [f"{by[q] / by['mosaic']:.2f}" if by.get(q) and by.get("mosaic") else "-" for q in quant]
      lines.append(f"| {case['shape']} | {case['groups']} | {case['sizes']} | {mode} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(json_path: Path) -> Path:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  results = json.loads(json_path.read_text())
  backends = results["backends"]
  labels, values = [], {b: [] for b in backends}
  for case in results["cases"]:
    labels.append(f"{case['shape']}\nG={case['groups']} {case['sizes'][:4]}")
    by = {r["backend"]: r for r in case["rows"] if r["mode"] == "fwd+bwd"}
    for b in backends:
      values[b].append(by.get(b, {}).get("tflops", 0.0))
  fig, ax = plt.subplots(figsize=(max(10, len(labels) * 1.3), 5))
  width = 0.8 / len(backends)
  for i, b in enumerate(backends):
    ax.bar(np.arange(len(labels)) + i * width, values[b], width, label=b)
  ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, fontsize=8)
  ax.set_ylabel("TFLOP/s (useful), forward + backward")
  ax.set_title(f"Grouped GEMM on {results['machine']['device']}, M={M}, bf16")
  ax.legend(fontsize=8)
  fig.tight_layout()
  out = json_path.with_suffix(".png")
  fig.savefig(out, dpi=120)
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path)
  ap.add_argument("--tune", action="store_true")
  ap.add_argument(
    "--tune-groups", type=int, default=8, help="group count the tiles are tuned at (stored as a :g<N> regime)"
  )
  ap.add_argument("--tune-kernels", default=None, help="Mosaic kernel set to tune (default: the backend's default)")
  ap.add_argument("--tune-only", action="store_true", help="tune, write the table, skip the benchmark")
  ap.add_argument("--quick", action="store_true", help="G=8 balanced and G=32 skewed only")
  ap.add_argument(
    "--cases", default="", help="cases to run instead, comma-separated GROUPS:SIZES, e.g. 32:balanced,8:balanced"
  )
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--plot", type=Path)
  ap.add_argument(
    "--quant",
    default="",
    help="comma-separated quantizations to add as mosaic+<q> rows: fp8_blockwise, fp8_blockwise:VARIANT (a Mosaic kernel variant), mxfp8, mxfp8:IMPL (an mxfp8_impl)",
  )
  ap.add_argument(
    "--fp8-tiles",
    default="",
    help="extra fp8_blockwise kernel tiles to time, comma-separated MxNxSTAGESxGRIDN[ws|wsb], e.g. 64x128x6x4,128x128x4x4ws,128x128x4x4wsb (ws: warp-specialized; wsb: and one weight scale per tile and K step)",
  )
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return 0
  cases = [(8, "balanced"), (32, "skewed")] if args.quick else CASES
  if args.cases:
    cases = parse_cases(ap, args.cases)
  from MaxText import quant as quant_registry

  if bad := [q for q in args.quant.split(",") if q and q not in quant_registry.labels()]:
    ap.error(f"--quant {','.join(bad)}: choose from {', '.join(quant_registry.labels())}")
  if bad := [t for t in args.fp8_tiles.split(",") if t and not re.fullmatch(r"\d+x\d+x\d+x\d+(ws|wsb)?", t)]:
    ap.error(
      f"--fp8-tiles {','.join(bad)}: each is MxNxSTAGESxGRIDN with an optional ws or wsb suffix, e.g. 128x128x4x4ws"
    )
  args.out.mkdir(parents=True, exist_ok=True)
  results = {"machine": machine(), "rows_M": M}
  if args.tune:
    from MaxText.moe.gmm import mosaic

    results["tuning"] = tune(args.out, 5, args.tune_kernels or mosaic.DEFAULT_KERNELS, args.tune_groups)["tiles"]
    if args.tune_only:
      return 0
  results["cases"] = []
  for (shape, (k, n)), (g, kind) in itertools.product(SHAPES.items(), cases):
    quant, tiles = (tuple(v for v in a.split(",") if v) for a in (args.quant, args.fp8_tiles))
    rows = jax_rows(k, n, g, kind, args.iters, quant, tiles) + torch_rows(k, n, g, kind, args.iters)
    results["cases"].append({"shape": shape, "k": k, "n": n, "groups": g, "sizes": kind, "rows": rows})
    (args.out / "grouped_gemm.json").write_text(json.dumps({**results, "backends": []}, indent=1))
  results["backends"] = list(dict.fromkeys(r["backend"] for c in results["cases"] for r in c["rows"]))
  (args.out / "grouped_gemm.json").write_text(json.dumps(results, indent=1))
  (args.out / "grouped_gemm.md").write_text(markdown(results) + quant_summary(results))
  print(markdown(results) + quant_summary(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
