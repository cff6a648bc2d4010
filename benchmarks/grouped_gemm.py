"""Grouped-GEMM benchmark at DeepSeek-V3 expert shapes: every expert GEMM side by side, in one run.

  python benchmarks/grouped_gemm.py --out DIR [--tune] [--quick]
  python benchmarks/grouped_gemm.py --plot DIR/grouped_gemm.json      # bar chart PNG (needs matplotlib)
  python benchmarks/grouped_gemm.py --out DIR --quick --quant fp8_blockwise,mxfp8,mxfp8:block_scaled  # + quantised
  python benchmarks/grouped_gemm.py --out DIR --quick --fp8-tiles 256x3x4,128x4x4w128x3   # fp8_blockwise tile sweep

Shapes: gate+up (K=7168 -> N=4096) and down (K=2048 -> N=7168), M=32768 token rows, G in {4, 8, 32}
groups, balanced and skewed (Dirichlet(0.5), seed 0) group sizes rounded to multiples of 16 (what
torch._grouped_mm needs). Rows: every unquantised entry of the expert-GEMM registry (MaxText/gmm/:
xla, padded, mosaic, tokamax, ...) that can run here (padded on the equal-capacity layout, every group
padded to the largest), JAX's own Mosaic GPU kernels as a peer (jax_ragged_dot_mgpu: ragged_dot_mgpu and
transposed_ragged_dot_mgpu, the kernels `mosaic` replaced), the dense GEMM of the same FLOPs, and
torch._grouped_mm when a CUDA torch is importable; forward and forward+backward (dx and dw). --quant
adds quantised entries by registry name (mxfp8:mosaic, fp8_blockwise:mosaic, ...; a bare quantization
is what it runs on this device with moe_gmm_backend=auto; `all`: every quantised entry). JAX timings
are device kernel time from CUPTI (Mosaic GPU's profiler), torch's from CUDA events; both after
warm-up, median of repeats. TFLOP/s count useful FLOPs only (2MKN forward, 6MKN forward+backward), so
padding shows up as lost throughput.

--fp8-tiles times fp8_blockwise:mosaic at other tiles (gmm.fp8_blockwise.MosaicKernels' arguments):
BLOCK_NxSTAGESxGRID_N for the forward and dgrad kernels, optionally followed by wBLOCK_NxSTAGES for the
weight-gradient kernel (block_m is 128 throughout); rows "fp8_blockwise:mosaic[TILES]".

--tune first searches tile parameters of the bf16 Mosaic kernels (MaxText/kernels/mosaic_gmm.py) for
each kernel and width pair at --tune-groups balanced groups, merges them into a copy of this GPU's
table (MaxText/kernels/mosaic_tiles_<gpu>.json, e.g. _h100; a new one if it has none) as that group-count
regime ("fwd:7168x4096:g32"), writes it into DIR (copy it to MaxText/kernels/ to make it this GPU's tuned
table) and benchmarks with it (--tune-only: stop after tuning). Without --tune the benchmark runs with the
table MaxText/kernels/mosaic_tiles.py chooses for this GPU, recorded as "tile_table" in the results.
"""

import argparse
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

M = 32768
PEER = "jax_ragged_dot_mgpu"  # JAX's own Mosaic GPU grouped-GEMM kernels, a peer row
# Their tiles (block_m, block_n, block_k, max_concurrent_steps, grid_block_n) as they ran here: single-warpgroup
# kernels, untuned (benchmarks/results/2026-12-03-h200-ws-kernels).
PEER_TILES = {"fwd": (128, 128, 64, 5, 4), "dgrad": (128, 128, 64, 5, 4), "wgrad": (128, 128, 64, 4, 1)}
FP8_TILES = re.compile(r"(\d+)x(\d+)x(\d+)(?:w(\d+)x(\d+))?")  # --fp8-tiles: BLOCK_NxSTAGESxGRID_N[wBLOCK_NxSTAGES]
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


def quant_choices() -> list[str]:
  """--quant's names (gmm_profile.py's too): each quantization alone, each quantised registry entry, `all`."""
  from MaxText import gmm

  return [*(q for q in gmm.quantizations() if q), *(n for n, e in gmm.EXPERT_GEMMS.items() if e.quantization), "all"]


def check_quant(ap: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
  """--quant, checked against quant_choices() before anything runs (a usage error, exit code 2)."""
  names = tuple(q for q in text.split(",") if q)
  if bad := [q for q in names if q not in quant_choices()]:
    ap.error(f"--quant {','.join(bad)}: choose from {', '.join(quant_choices())}")
  return names


def quant_entries(names, device) -> list[str]:
  """The registry entries --quant names on `device`: a bare quantization is what quantization=q with
  moe_gmm_backend=auto and mxfp8_impl=auto runs there; `all` is every quantised entry."""
  from MaxText import gmm

  entries = []
  for q in names:
    if q == "all":
      entries += [n for n, e in gmm.EXPERT_GEMMS.items() if e.quantization]
    elif q in gmm.EXPERT_GEMMS:
      entries.append(q)
    else:
      entries.append(gmm.resolve(q, "auto", "auto", device, "bfloat16").name)
  return list(dict.fromkeys(entries))


def fp8_tiles_gemm(tiles: str):
  """fp8_blockwise:mosaic at the tiles --fp8-tiles names (gmm.fp8_blockwise.MosaicKernels' arguments)."""
  from MaxText.gmm import fp8_blockwise

  block_n, stages, grid_n, wgrad_n, wgrad_stages = FP8_TILES.fullmatch(tiles).groups()
  wgrad = {} if wgrad_n is None else {"block_n": int(wgrad_n), "max_concurrent_steps": int(wgrad_stages)}
  kernels = fp8_blockwise.MosaicKernels(
    block_n=int(block_n), max_concurrent_steps=int(stages), grid_block_n=int(grid_n), wgrad=wgrad
  )
  return fp8_blockwise.Fp8BlockwiseGemm(f"fp8_blockwise:mosaic[{tiles}]", kernels)


def jax_peer_gemm():
  """JAX's own Mosaic GPU kernels (ragged_dot_mgpu forward and dgrad, transposed_ragged_dot_mgpu wgrad) under
  the same VJP and width padding as `mosaic`, at PEER_TILES: a peer row (gmm_profile.py's too)."""
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

  from MaxText.gmm.base import KernelGemm
  from MaxText.kernels.mosaic_tiles import PAD, TILE_NAMES
  from MaxText.kernels.padding import pad_rows, pad_to

  tiles = {kernel: dict(zip(TILE_NAMES, t)) for kernel, t in PEER_TILES.items()}

  def fwd(x, w, sizes):
    m, n = x.shape[0], w.shape[2]
    xp, wp = pad_rows(pad_to(x, 1, PAD), tiles["fwd"]["block_m"]), pad_to(pad_to(w, 1, PAD), 2, PAD)
    return ragged_dot_mgpu.ragged_dot(xp, wp, group_sizes=sizes.astype(jnp.int32), **tiles["fwd"])[:m, :n]

  def dgrad(dy, w, sizes):
    m, k = dy.shape[0], w.shape[1]
    dyp, wp = pad_rows(pad_to(dy, 1, PAD), tiles["dgrad"]["block_m"]), pad_to(pad_to(w, 1, PAD), 2, PAD)
    dx = ragged_dot_mgpu.ragged_dot(dyp, wp, group_sizes=sizes.astype(jnp.int32), transpose_rhs=True, **tiles["dgrad"])
    return dx[:m, :k]

  def wgrad(x, dy, sizes):
    k, n = x.shape[1], dy.shape[1]
    xp, dyp = pad_to(x, 1, PAD), pad_to(dy, 1, PAD)
    dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
      xp, dyp, group_sizes=sizes.astype(jnp.int32), **tiles["wgrad"]
    )
    return dw[:, :k, :n]

  return KernelGemm(PEER, fwd, dgrad, wgrad)


def bf16_entries() -> list[str]:
  """The unquantised registry entries, each a row of the benchmark (quantised ones come with --quant)."""
  from MaxText import gmm

  return [n for n, e in gmm.EXPERT_GEMMS.items() if not e.quantization]


def runnable(name: str, device) -> str | None:
  """Why registry entry `name` cannot run on `device` (a package missing, another GPU architecture), or None."""
  from MaxText import gmm

  if problem := gmm.unavailable(name) or gmm.not_runnable_on(name, device):
    return problem
  if gmm.EXPERT_GEMMS[name].hopper_only and device.platform != "gpu":
    return f"{name} runs Hopper (sm_90) kernels; {device.platform} is no GPU"
  return None


def jax_rows(
  k: int, n: int, g: int, kind: str, iters: int, quant: tuple[str, ...] = (), fp8_tiles: tuple[str, ...] = ()
) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from MaxText import gmm

  device = jax.devices()[0]
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

  def add_gemm(label, f):
    add(label, lambda x, w, dy: f(x, w, sizes), grad_fn(lambda x, w: f(x, w, sizes)), (x, w, dy))

  # Every unquantised registry entry that runs here; padded (equal-capacity groups) below, on its layout.
  for name in bf16_entries():
    if gmm.EXPERT_GEMMS[name].backend == "padded":
      continue
    if problem := runnable(name, device):
      print(f"{name}: skipped ({problem})", flush=True)
      continue
    add_gemm(name, gmm.build(name))
  if runnable("mosaic", device) is None:  # JAX's kernels run where ours do
    add_gemm(PEER, jax_peer_gemm())
  # --quant: the quantised expert GEMMs, quantisation passes included in the time.
  for name in quant_entries(quant, device):
    if problem := runnable(name, device):
      print(f"{name}: skipped ({problem})", flush=True)
      continue
    add_gemm(name, gmm.build(name))
  for tiles in fp8_tiles:
    if problem := runnable("fp8_blockwise:mosaic", device):
      print(f"--fp8-tiles {tiles}: skipped ({problem})", flush=True)
      continue
    add_gemm(f"fp8_blockwise:mosaic[{tiles}]", fp8_tiles_gemm(tiles))

  # Fixed capacity: every group padded to the largest group (rounded to 128 rows).
  cap = int(-(-sizes_np.max() // 128) * 128)
  starts = np.concatenate([[0], np.cumsum(sizes_np)[:-1]])
  index = np.full((g, cap), M, np.int32)  # M -> a zero row
  for e in range(g):
    index[e, : sizes_np[e]] = starts[e] + np.arange(sizes_np[e])
  index = jnp.asarray(index)

  for name in bf16_entries():
    if gmm.EXPERT_GEMMS[name].backend != "padded" or runnable(name, device):
      continue
    f, cap_sizes = gmm.build(name), jnp.full((g,), cap, jnp.int32)

    def padded(x, w, f=f, cap_sizes=cap_sizes):
      xp = jnp.take(jnp.concatenate([x, jnp.zeros((1, k), x.dtype)]), index.reshape(-1), axis=0)
      return f(xp, w, cap_sizes)

    dyp = jnp.zeros((g * cap, n), jnp.bfloat16)
    add(name, lambda x, w, dy, p=padded: p(x, w), grad_fn(padded), (x, w, dyp), extra={"pad_factor": g * cap / M})

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
def tune(out_dir: Path, iters: int, groups: int) -> dict:
  """Searches tiles of the bf16 Mosaic kernels (kernels/mosaic_gmm.py) for each kernel and width pair at
  `groups` balanced groups.

  Results merge into a copy of this GPU's table (MaxText/kernels/mosaic_tiles_<gpu>.json; a new one if it
  has none) under "<kernel>:<K>x<N>:g<groups>" keys (used by mosaic_tiles.tiles_for for that group-count
  regime), written to out_dir/mosaic_tiles_<gpu>.json, which the benchmark then runs with.
  """
  import jax
  import jax.numpy as jnp

  from MaxText.kernels import mosaic_gmm, mosaic_tiles

  sizes = jnp.asarray(group_sizes(M, groups, "balanced"))
  # Two consumer warpgroups share each tile (block_n of fwd/dgrad, block_m of wgrad is each one's half): 2-3
  # stages fit in shared memory.
  fwd_space = [(128, 128, 64, st, gb) for st, gb in itertools.product((2, 3), (2, 4, 8, 16))]
  wgrad_space = [
    (bm, bn, 64, st, gb) for (bm, bn), st, gb in itertools.product(((128, 128), (64, 256)), (2, 3), (1, 4, 8))
  ]
  kind = jax.devices()[0].device_kind
  name = mosaic_tiles.table_name(kind) or kind.lower().replace("nvidia", "").strip().replace(" ", "_")
  file = mosaic_tiles.table_path(name)  # this GPU's own table, never another GPU's
  table = json.loads(file.read_text()) if file.exists() else {"tiles": {}}
  measured = table.setdefault("tflops_by_tiles", {})
  for (k, n), kernel in itertools.product(SHAPES.values(), mosaic_tiles.KERNELS):
    # Widths as the kernel sees them: fwd contracts k into n; dgrad contracts n into k; wgrad (k, n).
    key = (f"{kernel}:{k}x{n}" if kernel != "dgrad" else f"{kernel}:{n}x{k}") + f":g{groups}"
    x = jax.random.normal(jax.random.key(1), (M, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (groups, k, n), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(3), (M, n), jnp.bfloat16)
    results = {}
    for tiles in wgrad_space if kernel == "wgrad" else fwd_space:
      kw = dict(zip(mosaic_tiles.TILE_NAMES, tiles))
      if kernel == "wgrad":  # (2 * block_m, block_n) output tiles over (k, n)
        if k % (2 * kw["block_m"]) or n % kw["block_n"]:
          continue
      elif (n if kernel == "fwd" else k) % (2 * kw["block_n"] * kw["grid_block_n"]):  # (block_m, 2 * block_n) tiles
        continue
      if kernel == "fwd":
        fn, args = (lambda x, w, kw=kw: mosaic_gmm.ragged_dot(x, w, sizes, **kw)), (x, w)
      elif kernel == "dgrad":
        fn, args = (lambda dy, w, kw=kw: mosaic_gmm.ragged_dot(dy, w, sizes, transpose_rhs=True, **kw)), (dy, w)
      else:
        fn, args = (lambda x, dy, kw=kw: mosaic_gmm.ragged_wgrad(x, dy, sizes, **kw)), (x, dy)
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
  path = out_dir / file.name
  path.write_text(json.dumps(table, indent=1))
  mosaic_tiles.use_table(path)  # the benchmark below runs with the tuned table
  return table


# ---- report ----
def runs_on_mosaic(label: str) -> bool:
  """Whether a row runs on our Mosaic kernels: a registry entry on moe_gmm_backend=mosaic (or an --fp8-tiles row)."""
  from MaxText import gmm

  entry = gmm.EXPERT_GEMMS.get(label.split("[")[0])
  return entry is not None and entry.backend == "mosaic"


def is_quantised(label: str) -> bool:
  from MaxText import gmm

  entry = gmm.EXPERT_GEMMS.get(label.split("[")[0])
  return entry is not None and bool(entry.quantization)


def markdown(results: dict) -> str:
  m = results["machine"]
  leads = [b for b in results["backends"] if runs_on_mosaic(b)]
  others = ("torch._grouped_mm", "dense", "xla")
  ratio_names = [f"{lead}/{o.split('.')[-1]}" for lead in leads for o in others]
  lines = [
    f"# Grouped GEMM, M={M} rows, bf16 ({m['gpu']}; jax {m['jax']}, torch {m.get('torch')}, {m['date']})",
    "",
    "TFLOP/s of useful work (padding counts as lost time). Ratios: each row on our Mosaic kernels over the named row.",
    "",
    f"Tiles: {m.get('tile_table', 'not recorded')}.",
    "",
    "| shape | G | sizes | mode | " + " | ".join(results["backends"] + ratio_names) + " |",
    "|---" * (4 + len(results["backends"]) + len(ratio_names)) + "|",
  ]
  for case in results["cases"]:
    for mode in ("fwd", "fwd+bwd"):
      by = {r["backend"]: r for r in case["rows"] if r["mode"] == mode}
      cells = [f"{by[b]['tflops']:.0f}" if "tflops" in by.get(b, {}) else "-" for b in results["backends"]]

      def ratio(a, b, by=by):
        if "tflops" in by.get(a, {}) and "tflops" in by.get(b, {}):
          return f"{by[a]['tflops'] / by[b]['tflops']:.2f}"
        return "-"

      cells += [ratio(lead, o) for lead in leads for o in others]
      lines.append(f"| {case['shape']} | {case['groups']} | {case['sizes']} | {mode} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def quant_summary(results: dict) -> str:
  """Quantised rows (--quant, --fp8-tiles) against bf16 mosaic (issue 7's target: fp8_blockwise >= 1.4x fwd+bwd)."""
  quant = [b for b in results["backends"] if is_quantised(b)]
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
    help="comma-separated quantised expert GEMMs to add as rows: registry names (mxfp8:mosaic, mxfp8:block_scaled, "
    "fp8_blockwise:mosaic, ...), a bare quantization (what it runs here with moe_gmm_backend=auto), or all",
  )
  ap.add_argument(
    "--fp8-tiles",
    default="",
    help="fp8_blockwise:mosaic tiles to time too, comma-separated BLOCK_NxSTAGESxGRID_N[wBLOCK_NxSTAGES] "
    "(forward/dgrad kernels, then optionally the wgrad kernel's; block_m 128), e.g. 256x3x4,128x4x4w128x3",
  )
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return 0
  cases = [(8, "balanced"), (32, "skewed")] if args.quick else CASES
  if args.cases:
    cases = parse_cases(ap, args.cases)
  quant = check_quant(ap, args.quant)
  tiles = tuple(t for t in args.fp8_tiles.split(",") if t)
  if bad := [t for t in tiles if not FP8_TILES.fullmatch(t)]:
    ap.error(
      f"--fp8-tiles {','.join(bad)}: each is BLOCK_NxSTAGESxGRID_N, optionally followed by wBLOCK_NxSTAGES for the "
      "wgrad kernel, e.g. 256x3x4 or 256x3x4w128x4 (block_m is 128; the kernels are always warp-specialized with "
      "the weights' block scales)"
    )
  if not args.out:
    ap.error("--out is required (or --plot)")
  args.out.mkdir(parents=True, exist_ok=True)
  results = {"machine": machine.describe(packages=("jax", "jaxlib", "torch")), "rows_M": M}
  if args.tune:
    results["tuning"] = tune(args.out, 5, args.tune_groups)["tiles"]
    if args.tune_only:
      return 0
  from MaxText.kernels import mosaic_tiles

  results["machine"]["tile_table"] = mosaic_tiles.table_note()
  print(results["machine"]["tile_table"], flush=True)
  results["cases"] = []
  for (shape, (k, n)), (g, kind) in itertools.product(SHAPES.items(), cases):
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
