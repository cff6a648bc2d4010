"""Remat and host activation offload on one GPU: peak device memory, step time, and whether the copies overlap.

  python3 benchmarks/remat_offload.py --out DIR  # the 1-GPU proxy, mosaic grouped GEMM (~5 min on an H200)
  python3 benchmarks/remat_offload.py --out DIR --small          # the tiny model on CPU: checks the script end to end

Variants, each in its own process (peak memory is per process), on recipes/deepseek_v3_proxy_1gpu/optimized.yml:

  offload  remat_policy=custom: the layer inputs and the routed experts' gate/up rows kept in pinned host memory
  device   the same tensors kept in device memory (what offload is measured against: same compute, other memory)
  full     remat_policy=full: only the layer inputs kept
  none     no remat
  state_offload  (only when named in --variants) full remat, optimizer state and master weights in pinned host memory

Each worker compiles the train step (memory_analysis: device and host temporaries), runs warm-up steps, times
steps (host wall time around each step with block_until_ready, median), reads the device's peak memory, and the
offload worker records a profile of two steps (jax.profiler, perfetto trace) and measures how much of the
device<->host copy time overlaps kernels on the GPU's streams. Correctness: every variant trains on the same
batches from the same initial state; the losses must match the no-remat losses (remat changes no math; bf16
fusion differences stay below the tolerance).

Expected offloaded bytes are computed from the model shapes (MaxText/remat.py tensor_bytes) for the layers of
scanned stacks with more than one layer (XLA keeps a one-layer stack's saved tensors on the device; the
compile-only test tests/test_gpu_lowering.py checks the same accounting). Pass criteria (from the issue):
peak(device) - peak(offload) >= 0.8 x expected offloaded bytes, and step(offload) <= 1.05 x step(device).
Writes DIR/remat_offload.json and DIR/remat_offload.md (and one DIR/<variant>.json per worker).
"""

import argparse
import bisect
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "benchmarks"))

import machine  # noqa: E402

RECIPE = "recipes/deepseek_v3_proxy_1gpu/optimized.yml"
SMALL_RECIPE = "recipes/deepseek_v3_tiny.yml"
# The tiny model with two layers per stack (a one-layer stack keeps nothing in host memory), float32 on CPU.
SMALL_OVERRIDES = (
  "max_target_length=32",
  "per_device_batch_size=4",
  "mtp_num_layers=0",
  "base_num_decoder_layers=4",
  "first_num_dense_layers=2",
  "ici_fsdp_parallelism=1",
)
OFFLOADED = ("decoder_layer_input", "moe_mlpwi_0", "moe_mlpwi_1")
VARIANTS = {
  "offload": ("remat_policy=custom", *(f"{n}=offload" for n in OFFLOADED)),
  "device": ("remat_policy=custom", *(f"{n}=device" for n in OFFLOADED)),
  "full": ("remat_policy=full",),
  "none": ("remat_policy=none",),
  # Not in the default list (time budget): full remat with the AdamW moments and fp32 master weights in host memory.
  "state_offload": ("remat_policy=full", "optimizer_memory_host_offload=true", "parameter_memory_host_offload=true"),
}
DEFAULT_VARIANTS = ("offload", "device", "full", "none")
LOSS_RTOL = 2e-3  # bf16: recomputation may fuse differently; a wrong policy or a lost tensor moves the loss far more


# ---- profile: do the device<->host copies overlap compute? ----
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  merged = []
  for s, e in sorted(intervals):
    if merged and s <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], e))
    else:
      merged.append((s, e))
  return merged


def _covered(union: list[tuple[float, float]], starts: list[float], s: float, e: float) -> float:
  """Length of [s, e) covered by the sorted disjoint intervals `union` (starts = their start points)."""
  total, i = 0.0, max(bisect.bisect_right(starts, s) - 1, 0)
  while i < len(union) and union[i][0] < e:
    total += max(0.0, min(e, union[i][1]) - max(s, union[i][0]))
    i += 1
  return total


def copy_direction(name: str) -> str | None:
  """'d2h', 'h2d', 'other' (device-to-device copies, memsets) or None (a kernel) for a GPU stream event name."""
  n = name.lower().replace(" ", "")
  if re.search(r"d(evice)?(2|to)h(ost)?|devicetopinned|device->pinned", n):
    return "d2h"
  if re.search(r"h(ost)?(2|to)d(evice)?|pinnedtodevice|pinned->device", n):
    return "h2d"
  if "memcpy" in n or "memset" in n:
    return "other"
  return None


def overlap_summary(trace_events: list[dict]) -> dict:
  """From a Chrome/perfetto trace: per GPU, the D2H and H2D copy time and the part of it during kernels.

  Only CUPTI stream lines count ('Stream #...' threads of '/device:GPU:N' processes); the derived 'XLA Ops' and
  'XLA Modules' lines repeat the kernels or span whole steps and would make every copy look overlapped.
  """
  pids = {e["pid"]: e["args"]["name"] for e in trace_events if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {
    (e["pid"], e["tid"]): e["args"]["name"]
    for e in trace_events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  gpu_pids = {pid for pid, name in pids.items() if re.search(r"/device:GPU:\d+", name)}
  kernels, copies, names = {}, {}, {}
  for e in trace_events:
    if e.get("ph") != "X" or e.get("pid") not in gpu_pids or "dur" not in e:
      continue
    if not threads.get((e["pid"], e.get("tid")), "").startswith("Stream"):
      continue
    span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    kind = copy_direction(e.get("name", ""))
    names[e.get("name", "")] = names.get(e.get("name", ""), 0) + 1
    if kind is None:
      kernels.setdefault(e["pid"], []).append(span)
    elif kind in ("d2h", "h2d"):
      copies.setdefault((e["pid"], kind), []).append(span)
  result = {
    "gpu_processes": sorted(pids[p] for p in gpu_pids),
    "top_event_names": sorted(names.items(), key=lambda kv: -kv[1])[:25],
  }
  for pid in gpu_pids:
    union = _union(kernels.get(pid, []))
    starts = [s for s, _ in union]
    for kind in ("d2h", "h2d"):
      spans = copies.get((pid, kind), [])
      total = sum(e - s for s, e in spans)
      during = sum(_covered(union, starts, s, e) for s, e in spans)
      result[f"{pids[pid]} {kind}"] = {
        "copies": len(spans),
        "copy_ms": total / 1e3,
        "overlapped_ms": during / 1e3,
        "overlap_fraction": during / total if total else None,
        "exposed_ms": (total - during) / 1e3,
      }
    result[f"{pids[pid]} kernel_busy_ms"] = sum(e - s for s, e in union) / 1e3
  return result


def load_trace(profile_dir: Path) -> list[dict]:
  files = sorted(profile_dir.rglob("*.trace.json.gz")) or sorted(profile_dir.rglob("perfetto_trace.json.gz"))
  if not files:
    raise FileNotFoundError(f"no trace.json.gz under {profile_dir}")
  with gzip.open(files[-1], "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


# ---- one variant, in its own process ----
def worker(args) -> dict:
  from MaxText import remat, runtime_env
  from MaxText.config import load_config

  overrides = [*args.override, *VARIANTS[args.worker]]
  if not args.small:
    overrides += ["env_presets=mem_fraction_95", f"xla_flag_presets={args.xla_flag_presets}"]
  cfg = load_config(args.recipe, overrides)
  applied = runtime_env.apply(cfg.train)  # before JAX starts

  import jax

  from MaxText.data import SyntheticData
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  trainer = Trainer(cfg, mesh)
  seq = cfg.train.max_target_length
  data = SyntheticData(cfg.data, trainer.global_batch, seq, cfg.model.vocab_size)
  batches = [trainer.device_batch(data.batch(i)) for i in range(args.warmup + args.steps + 2)]
  state = trainer.init_state()
  t0 = time.perf_counter()
  step = trainer.jit_step().lower(state, batches[0]).compile()
  compile_s = time.perf_counter() - t0
  mem = step.memory_analysis()
  losses, times = [], []
  for i in range(args.warmup + args.steps):
    t = time.perf_counter()
    state, metrics = step(state, batches[i])
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t)
    losses.append(float(metrics["loss"]))
  stats = jax.local_devices()[0].memory_stats() or {}
  out = {
    "variant": args.worker,
    "overrides": overrides,
    "remat": remat.describe(cfg.model),
    "xla_flags": applied["xla_flags"],
    "device_kind": jax.devices()[0].device_kind,
    "compile_s": compile_s,
    "losses": losses,
    "step_times_s": times,
    "median_step_s": statistics.median(times[args.warmup :]),
    "peak_bytes": stats.get("peak_bytes_in_use"),
    "bytes_limit": stats.get("bytes_limit"),
    "temp_bytes": mem.temp_size_in_bytes,
    "argument_bytes": mem.argument_size_in_bytes,
    "host_temp_bytes": mem.host_temp_size_in_bytes,
    "host_argument_bytes": mem.host_argument_size_in_bytes,
  }
  if args.profile:
    profile_dir = Path(args.out).parent / f"profile_{args.worker}"
    with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
      for i in range(2):
        state, metrics = step(state, batches[args.warmup + args.steps + i])
      jax.block_until_ready((state, metrics))
    try:
      out["profile"] = overlap_summary(load_trace(profile_dir))
      out["profile"]["trace_dir"] = str(profile_dir)
    except Exception as e:  # noqa: BLE001 - the numbers above stand without the profile; say why it is missing
      out["profile"] = {"error": f"{type(e).__name__}: {e}"}
  return out


def expected_offload_bytes(recipe: str, overrides: list[str]) -> dict:
  from MaxText import remat
  from MaxText.config import load_config

  cfg = load_config(recipe, [*overrides, *VARIANTS["offload"]])
  m, moe = cfg.model, cfg.moe
  batch, seq = cfg.train.per_device_batch_size, cfg.train.max_target_length
  per_layer = {kind: remat.tensor_bytes(m, moe, batch, seq, kind) for kind in ("dense", "moe")}
  stacks = {"dense": m.first_num_dense_layers, "moe": m.num_moe_layers, "mtp (moe)": m.mtp_num_layers}
  out = {"per_layer": {k: {n: v[n] for n in OFFLOADED if n in v} for k, v in per_layer.items()}, "stacks": stacks}
  total = in_host = 0
  for stack, layers in stacks.items():
    b = sum(per_layer["moe" if "moe" in stack else "dense"].get(n, 0) for n in OFFLOADED) * layers
    total += b
    in_host += b if layers > 1 else 0
  out["all_layers_bytes"], out["expected_bytes"] = total, in_host
  return out


# ---- the whole measurement ----
def gib(b) -> str:
  """Bytes as GiB (MiB below 1 GiB, for the --small run)."""
  if b is None:
    return "-"
  return f"{b / 2**30:.2f} GiB" if abs(b) >= 2**30 else f"{b / 2**20:.2f} MiB"


def markdown(results: dict) -> str:
  lines = [
    f"# Remat and host offload, {results['recipe']}",
    "",
    f"machine: {results['machine']}",
    "",
    "| variant | median step | peak device memory | device temp (compiled) | host temp (compiled) "
    "| losses match the reference |",
    "|---|---|---|---|---|---|",
  ]
  for name, r in results["variants"].items():
    if "error" in r:
      lines.append(f"| {name} | {r['error']} | | | | |")
      continue
    lines.append(
      f"| {name} | {r['median_step_s'] * 1e3:.1f} ms | {gib(r['peak_bytes'])} | {gib(r['temp_bytes'])} | "
      f"{gib(r['host_temp_bytes'])} | {r.get('losses_match_reference', '-')} |"
    )
  e = results["expected"]
  lines += [
    "",
    f"loss reference: {results.get('loss_reference')}",
    f"expected offloaded bytes (layers of stacks with > 1 layer): {gib(e['expected_bytes'])} "
    f"(all layers: {gib(e['all_layers_bytes'])}); stacks {e['stacks']}",
  ]
  for k, v in results.get("checks", {}).items():
    lines.append(f"- {k}: {v}")
  prof = results["variants"].get("offload", {}).get("profile")
  if prof:
    lines += ["", "## Offload profile (2 steps): device<->host copies against kernels on the GPU streams", ""]
    for k, v in prof.items():
      if isinstance(v, dict):
        frac = v["overlap_fraction"]
        lines.append(
          f"- {k}: {v['copies']} copies, {v['copy_ms']:.1f} ms, overlapped {v['overlapped_ms']:.1f} ms "
          f"({'-' if frac is None else f'{frac:.0%}'}), exposed {v['exposed_ms']:.1f} ms"
        )
      elif k not in ("top_event_names", "gpu_processes"):
        lines.append(f"- {k}: {v}")
  return "\n".join(lines) + "\n"


def checks(results: dict) -> dict:
  v, out = results["variants"], {}
  off, dev = v.get("offload", {}), v.get("device", {})
  expected = results["expected"]["expected_bytes"]
  if off.get("peak_bytes") and dev.get("peak_bytes"):
    saved = dev["peak_bytes"] - off["peak_bytes"]
    out["peak saved by offload vs device"] = f"{gib(saved)} of {gib(expected)} expected: " + (
      "PASS" if saved >= 0.8 * expected else "FAIL"
    )
  if "median_step_s" in off and "median_step_s" in dev:
    ratio = off["median_step_s"] / dev["median_step_s"]
    out["step time offload / device"] = f"{ratio:.3f} (<= 1.05): " + ("PASS" if ratio <= 1.05 else "FAIL")
  if "host_temp_bytes" in off:
    out["compiled host temporaries vs expected"] = f"{gib(off['host_temp_bytes'])} vs {gib(expected)}"
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="output directory (or, with --worker, the worker's JSON file)")
  ap.add_argument("--recipe", default=None)
  ap.add_argument("--override", action="append", default=[], help="extra key=value for every variant")
  ap.add_argument(
    "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, from: {', '.join(VARIANTS)}"
  )
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--xla-flag-presets", default="latency_hiding", help="xla_flag_presets for every variant (GPU)")
  ap.add_argument("--budget-s", type=float, default=290, help="start no variant after this many seconds")
  ap.add_argument("--worker-timeout-s", type=float, default=200)
  ap.add_argument("--small", action="store_true", help="the tiny model on CPU (checks the script)")
  ap.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
  ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  args.recipe = args.recipe or (SMALL_RECIPE if args.small else RECIPE)
  if args.small:
    args.override = [*SMALL_OVERRIDES, *args.override]

  if args.worker:
    result = worker(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0

  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = {
    "recipe": args.recipe,
    "overrides": args.override,
    "machine": machine.describe(devices=False),  # no JAX here: the workers measure the GPU
    "variants": {},
    "expected": expected_offload_bytes(args.recipe, args.override),
  }
  start = time.perf_counter()
  env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
  if args.small:
    env["JAX_PLATFORMS"] = "cpu"
  for name in args.variants.split(","):
    if time.perf_counter() - start > args.budget_s:
      results["variants"][name] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
      continue
    cmd = [
      sys.executable,
      __file__,
      "--worker",
      name,
      "--out",
      str(out / f"{name}.json"),
      "--recipe",
      args.recipe,
      "--warmup",
      str(args.warmup),
      "--steps",
      str(args.steps),
      "--xla-flag-presets",
      args.xla_flag_presets,
      *(["--small"] if args.small else []),
      *(["--profile"] if name == "offload" else []),
      *(f"--override={o}" for o in args.override if o not in SMALL_OVERRIDES),
    ]
    print("+", " ".join(cmd), flush=True)
    t = time.perf_counter()
    try:
      proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.worker_timeout_s)
      ok = proc.returncode == 0 and (out / f"{name}.json").exists()
      results["variants"][name] = (
        json.loads((out / f"{name}.json").read_text())
        if ok
        else {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr).splitlines()[-30:]}
      )
    except subprocess.TimeoutExpired:
      results["variants"][name] = {"error": f"timeout after {args.worker_timeout_s:.0f} s"}
    print(
      f"  {name}: {time.perf_counter() - t:.0f} s; "
      + json.dumps(
        {
          k: v
          for k, v in results["variants"][name].items()
          if k in ("median_step_s", "peak_bytes", "host_temp_bytes", "error")
        }
      ),
      flush=True,
    )
  # No remat is the reference; full remat stands in if none did not run (time budget, memory).
  ref_name = next((n for n in ("none", "full") if "losses" in results["variants"].get(n, {})), None)
  results["loss_reference"] = ref_name
  for r in results["variants"].values():
    if ref_name and "losses" in r:
      ref = results["variants"][ref_name]["losses"]
      r["losses_match_reference"] = all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(r["losses"], ref))
  results["checks"] = checks(results)
  (out / "remat_offload.json").write_text(json.dumps(results, indent=1))
  (out / "remat_offload.md").write_text(markdown(results))
  print(markdown(results))
  failed = [n for n, r in results["variants"].items() if "error" in r or r.get("losses_match_reference") is False]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
