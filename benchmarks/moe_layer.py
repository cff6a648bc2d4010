"""One MoE layer at DeepSeek-V3 widths on one GPU: where the time goes, stage by stage, from device time.

  python3 benchmarks/moe_layer.py --out DIR [--backend MOE_GMM_BACKEND] [--compare-xla] [--pad 128] [--iters 20]
  python3 benchmarks/moe_layer.py --out DIR --small      # CPU dry run: tiny shapes, xla backend (CI)

The layer: hidden 7168, expert MLP 2048, 32 routed experts (the local experts of one EP rank of
DeepSeek-V3), 8192 tokens, top-8 with group-limited routing (8 groups, top 4), 1 shared expert,
bf16, dropless sort dispatch (MaxText/moe/permute.py), grouped GEMMs by `--backend` (a moe_gmm_backend
of the expert-GEMM registry, MaxText/gmm/; auto decided for the device; mosaic by default). Forward and
forward+backward (gradients of every parameter and of x), split into the layer's named scopes: router,
permute, gmm (the expert GEMMs and the SwiGLU between them), combine (unpermute and weighted sum),
shared_experts; "other" is whatever lies outside them.

Two measurements, both device time, after warm-up, medians over iterations:
  trace   jax.profiler.trace of the whole jitted layer; every device kernel event carries the HLO
          instruction it ran for (stat `hlo_op`, from XLA's kernel annotations); the compiled HLO
          gives that instruction's op_name, e.g. `jit(fwd_bwd)/transpose(jvp(permute))/...`, which
          names the scope. Kernel times are summed per scope per iteration; "unattributed" is device
          activity without an HLO op (memcpy, ...).
  stages  each stage as its own jitted function on the same inputs, timed with CUPTI (Mosaic GPU's
          profiler) where available, else on the host; plus the whole layer the same way.
The headline is the layer time over its expert-GEMM time (target <= 1.25), from the trace.

Before timing, the layer's output and gradients are checked against a float32 reference (same
bf16-rounded inputs, xla grouped GEMM, highest matmul precision) at --check-tokens tokens, with
group padding off and on; freed device memory is filled with NaN first, so unwritten outputs show.
Writes DIR/moe_layer.json and DIR/moe_layer.md.
"""

import argparse
import dataclasses
import glob
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # grouped_gemm, for its timer

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText import gmm, params, profile  # noqa: E402
from MaxText.config import load_config  # noqa: E402
from MaxText.layers.mlp import mlp  # noqa: E402
from MaxText.moe import permute, router  # noqa: E402
from MaxText.moe.layer import expert_gemm, moe, moe_specs, routed_experts  # noqa: E402
from MaxText.sharding import Sharder  # noqa: E402
import machine  # noqa: E402
from grouped_gemm import jax_time_ms  # noqa: E402

STAGES = ("router", "permute", "gmm", "combine", "shared_experts")
SCOPE = re.compile(r"\b(" + "|".join(STAGES) + r")\b")
BOUND = 2e-2  # relative Frobenius error of bf16 vs float32 through three chained GEMMs
FULL = dict(hidden=7168, mlp=2048, experts=32, tokens=8192, k=8, groups=8, topk_groups=4)
SMALL = dict(hidden=64, mlp=32, experts=8, tokens=64, k=2, groups=4, topk_groups=2)


# ---- the layer ----
def make_config(shape: dict, backend: str, pad: int):
  """`backend`: a moe_gmm_backend (auto decided already)."""
  return load_config(
    None,
    [
      f"num_experts={shape['experts']}",
      f"num_experts_per_tok={shape['k']}",
      f"base_moe_mlp_dim={shape['mlp']}",
      "shared_experts=1",
      "routed_scaling_factor=2.5",
      f"n_routing_groups={shape['groups']}",
      f"topk_routing_group={shape['topk_groups']}",
      f"moe_gmm_backend={backend}",
      f"moe_group_pad_multiple={pad}",
      "dtype=bfloat16",
    ],
  ).moe


def inputs(shape: dict, cfg, tokens: int, dtype=jnp.bfloat16, seed=0):
  @jax.jit
  def make(key):
    keys = jax.random.split(key, 4)
    p = params.initialize(moe_specs(shape["hidden"], cfg), keys[0], dtype, 0.02)
    x = jax.random.normal(keys[1], (1, tokens, shape["hidden"]), dtype)
    bias = jax.random.normal(keys[2], (cfg.num_experts,), jnp.float32) * 0.01
    cot = jax.random.normal(keys[3], x.shape, dtype)
    return p, x, bias, cot

  return make(jax.random.key(seed))


def layer_fns(cfg):
  def fwd(p, x, bias):
    return moe(p, x, bias, cfg, Sharder())[0]

  def fwd_bwd(p, x, bias, cot):
    out, vjp = jax.vjp(lambda p, x: fwd(p, x, bias), p, x)
    return out, *vjp(cot)

  return fwd, fwd_bwd


# ---- correctness ----
def poison_freed_memory(nbytes: int) -> None:
  """Fill soon-to-be-reused device memory with NaN, so outputs a kernel fails to write show up as NaN."""
  junk = jnp.full((max(nbytes, 2) // 2,), jnp.nan, jnp.bfloat16)
  junk.block_until_ready()
  del junk


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(shape: dict, backend: str, pads: list[int], tokens: int) -> list[dict]:
  cfg = make_config(shape, backend, 0)
  p, x, bias, cot = inputs(shape, cfg, tokens, seed=7)
  ref_cfg = dataclasses.replace(cfg, moe_gmm_backend="xla")
  up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
  with jax.default_matmul_precision("highest"):
    want = jax.tree.map(np.asarray, jax.jit(layer_fns(ref_cfg)[1])(up(p), up(x), bias, up(cot)))
  names = ["out"] + [f"d{jax.tree_util.keystr(k)}" for k, _ in jax.tree_util.tree_leaves_with_path((p, x))]
  results = []
  for pad in pads:
    poison_freed_memory(sum(a.nbytes for a in jax.tree.leaves(want)) * 2)
    got = jax.tree.map(
      np.asarray, jax.jit(layer_fns(dataclasses.replace(cfg, moe_group_pad_multiple=pad))[1])(p, x, bias, cot)
    )
    errors = {n: rel(g.astype(np.float32), w) for n, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want))}
    finite = all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(got))
    ok = finite and max(errors.values()) < BOUND
    print(
      f"check {backend} pad={pad} tokens={tokens}: {'ok' if ok else 'FAILED'} max rel error {max(errors.values()):.2e}",
      flush=True,
    )
    results.append(
      {
        "backend": backend,
        "pad": pad,
        "tokens": tokens,
        "finite": finite,
        "rel_errors": errors,
        "bound": BOUND,
        "ok": ok,
      }
    )
  return results


# ---- timing: whole layer from a profiler trace ----
def _stage(op_name: str) -> str | None:
  found = SCOPE.search(op_name)
  return found.group(1) if found else None


def _iterations(events: list, iters: int) -> list[list]:
  """Split (start_ns, end_ns, stage, op) events into `iters` runs at the iters-1 widest idle gaps
  (the host waits for each run, then sleeps, before starting the next)."""
  events = sorted(events, key=lambda e: e[0])
  if iters == 1 or len(events) < iters:
    return [events]
  ends = np.maximum.accumulate([e[1] for e in events])
  gaps = np.array([events[i + 1][0] - ends[i] for i in range(len(events) - 1)])
  cuts = sorted(np.argsort(-gaps, kind="stable")[: iters - 1] + 1)
  return [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)])]


def trace_breakdown(compiled, args, iters: int) -> dict:
  """Median per-iteration device time per stage (ms) from a jax.profiler trace of `compiled`."""
  module, stages = profile.hlo_labels(compiled.as_text(), _stage)
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(iters):
        jax.block_until_ready(compiled(*args))
        time.sleep(0.002)  # an idle gap on the device between runs
    raw, plane = profile.device_events(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0], module)
  events, unmatched = [], set()
  for start, end, op in raw:
    stage = stages.get(op, "other") if op else "unattributed"
    unmatched.update([op] if op and stage == "other" else [])
    events.append((start, end, stage, op))
  runs = _iterations(events, iters)
  out = {}
  for stage in (*STAGES, "other", "unattributed"):
    out[stage] = statistics.median(sum(e[1] - e[0] for e in run if e[2] == stage) / 1e6 for run in runs)
  out["total"] = statistics.median(sum(e[1] - e[0] for e in run) / 1e6 for run in runs)
  # Where each stage's time goes (the sorts, searches and gathers inside "permute", say): its longest ops.
  per_op = defaultdict(list)
  for run in runs:
    totals = defaultdict(float)
    for start, end, stage, op in run:
      totals[(stage, op)] += (end - start) / 1e6
    for key, ms in totals.items():
      per_op[key].append(ms)
  top = sorted(((stage, op, statistics.median(v)) for (stage, op), v in per_op.items()), key=lambda t: -t[2])
  out["top_ops"] = {
    stage: [[op, round(ms, 4)] for st, op, ms in top if st == stage][:8] for stage in (*STAGES, "other")
  }
  out["runs_found"] = len(runs)
  out["plane"] = plane
  out["other_ops"] = sorted(unmatched)[:20]
  return out


# ---- timing: each stage as its own jitted function ----
def stage_fns(cfg, p, x, bias) -> dict:
  """{stage: (fwd, fwd_bwd, args)} on the inputs the layer itself would give each stage."""
  gemm = expert_gemm(cfg)
  experts = {k: p[k] for k in ("wi_0", "wi_1", "wo")}

  @jax.jit
  def intermediates(p, x, bias):
    tokens = x.reshape(-1, x.shape[-1])
    r = router.route(tokens, p["gate"], bias, cfg)
    plan = permute.plan(r.expert_ids, cfg.num_experts, cfg.moe_group_pad_multiple)
    rows = permute.permute(tokens, plan)
    return tokens, r, plan, rows, routed_experts({k: p[k] for k in experts}, rows, plan.group_sizes, gemm)

  tokens, r, plan, rows, y = intermediates(p, x, bias)

  def with_grad(f, n_diff):  # gradients of the first n_diff arguments, cotangent of ones
    def run(*args):
      out, vjp = jax.vjp(lambda *d: f(*d, *args[n_diff:]), *args[:n_diff])
      return out, vjp(jnp.ones_like(out))

    return run

  route = lambda tokens, gate: router.route(tokens, gate, bias, cfg).weights  # noqa: E731

  def plan_and_permute(tokens, ids):
    return permute.permute(tokens, permute.plan(ids, cfg.num_experts, cfg.moe_group_pad_multiple))

  experts_fn = lambda rows, w, sizes: routed_experts(w, rows, sizes, gemm)  # noqa: E731
  combine = lambda y, weights, plan: permute.unpermute(y, weights, plan)  # noqa: E731
  shared = lambda x, w: mlp(w, x, Sharder())  # noqa: E731
  return {
    "router": (route, with_grad(route, 2), (tokens, p["gate"])),
    "permute": (plan_and_permute, with_grad(plan_and_permute, 1), (tokens, r.expert_ids)),
    "gmm": (experts_fn, with_grad(experts_fn, 2), (rows, experts, plan.group_sizes)),
    "combine": (combine, with_grad(combine, 2), (y, r.weights, plan)),
    "shared_experts": (shared, with_grad(shared, 2), (x, p["shared"])),
  }


def measure_trace(shape: dict, backend: str, pad: int, iters: int) -> dict:
  cfg = make_config(shape, backend, pad)
  p, x, bias, cot = inputs(shape, cfg, shape["tokens"])
  fwd, fwd_bwd = layer_fns(cfg)
  result = {"backend": backend, "pad": pad, "trace": {}}
  for mode, fn, args in (("fwd", fwd, (p, x, bias)), ("fwd+bwd", fwd_bwd, (p, x, bias, cot))):
    t = trace_breakdown(jax.jit(fn).lower(*args).compile(), args, iters)
    t["layer_over_gmm"] = t["total"] / t["gmm"] if t["gmm"] else None
    result["trace"][mode] = t
    print(
      backend,
      pad,
      mode,
      "trace",
      {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items() if k != "other_ops"},
      flush=True,
    )
  return result


def measure_stages(shape: dict, backend: str, pad: int, iters: int) -> dict:
  cfg = make_config(shape, backend, pad)
  p, x, bias, cot = inputs(shape, cfg, shape["tokens"])
  fwd, fwd_bwd = layer_fns(cfg)
  stages = {}
  for stage, (f, f_bwd, args) in stage_fns(cfg, p, x, bias).items():
    fwd_ms, timer = jax_time_ms(jax.jit(f), args, iters)
    both_ms, _ = jax_time_ms(jax.jit(f_bwd), args, iters)
    stages[stage] = {"fwd": fwd_ms, "fwd+bwd": both_ms, "timer": timer}
  layer_fwd, timer = jax_time_ms(jax.jit(fwd), (p, x, bias), iters)
  layer_both, _ = jax_time_ms(jax.jit(fwd_bwd), (p, x, bias, cot), iters)
  stages["layer"] = {"fwd": layer_fwd, "fwd+bwd": layer_both, "timer": timer}
  print(backend, pad, "stages", stages, flush=True)
  return stages


# ---- report ----
def markdown(results: dict) -> str:
  m, s = results["machine"], results["shape"]
  lines = [
    f"# One MoE layer, {s['tokens']} tokens, hidden {s['hidden']}, expert MLP {s['mlp']}, {s['experts']} experts "
    f"top-{s['k']}, 1 shared ({m.get('gpu') or m['device']}; jax {m['jax']}, {m['date']})",
    "",
    "Device time per step in ms, median over iterations, by named scope (from a profiler trace of the whole "
    "jitted layer).",
    "",
    "| backend | pad | mode | router | permute | gmm | combine | shared_experts | other | layer | layer / gmm "
    "| target 1.25 |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for run in results["runs"]:
    for mode, t in run.get("trace", {}).items():
      ratio = t["layer_over_gmm"]
      lines.append(
        f"| {run['backend']} | {run['pad']} | {mode} | "
        + " | ".join(f"{t[k]:.3f}" for k in STAGES)
        + f" | {t['other'] + t['unattributed']:.3f} | {t['total']:.3f}"
        + f" | {ratio:.3f} | {'met' if ratio and ratio <= 1.25 else 'not met'} |"
      )
  lines += [
    "",
    "Each stage as its own jitted function on the same inputs (ms; fwd / fwd+bwd):",
    "",
    "| backend | pad | " + " | ".join((*STAGES, "layer")) + " | timer |",
    "|---" * (len(STAGES) + 4) + "|",
  ]
  for run in results["runs"]:
    if "stages" not in run and "error" not in run:
      lines.append(f"| {run['backend']} | {run['pad']} | skipped (--no-stages) |")
      continue
    st = run.get("stages", {})
    if "error" in st or "error" in run:
      lines.append(f"| {run['backend']} | {run['pad']} | failed: {st.get('error') or run.get('error')} |")
      continue
    lines.append(
      f"| {run['backend']} | {run['pad']} | "
      + " | ".join(f"{st[k]['fwd']:.3f} / {st[k]['fwd+bwd']:.3f}" for k in (*STAGES, "layer"))
      + f" | {st['layer']['timer']} |"
    )
  lines += ["", "Correctness against float32 (max relative Frobenius error over output and gradients):", ""]
  for c in results["checks"]:
    lines.append(
      f"- {c['backend']}, pad {c['pad']}, {c['tokens']} tokens: {'ok' if c['ok'] else 'FAILED'}, "
      f"{max(c['rel_errors'].values()):.2e} (bound {c['bound']})"
    )
  return "\n".join(lines) + "\n"


def guarded(fn, partial: dict, strict: bool) -> dict:
  """fn()'s result, or `partial` with the error, so one failing measurement keeps the others (not in --small)."""
  if strict:
    return fn()
  try:
    return fn()
  except Exception as e:
    print(f"FAILED {partial}: {type(e).__name__}: {e}", flush=True)
    return {**partial, "error": f"{type(e).__name__}: {str(e)[:1000]}"}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument(
    "--backend",
    default="mosaic",
    choices=gmm.backends(),
    help="moe_gmm_backend of the expert GEMMs (auto: decided for this device)",
  )
  ap.add_argument("--compare-xla", action="store_true", help="also run the xla grouped GEMM")
  ap.add_argument("--pad", type=int, nargs="+", default=[0, 128], help="moe_group_pad_multiple values to run")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--check-tokens", type=int, default=1024)
  ap.add_argument("--small", action="store_true", help="CPU dry run: tiny shapes, xla backend, 2 iterations")
  ap.add_argument(
    "--no-stages", action="store_true", help="skip the per-stage CUPTI timings (the profiler trace alone)"
  )
  args = ap.parse_args()
  shape = SMALL if args.small else FULL
  backend = gmm.resolve_backend(args.backend, jax.devices()[0], "bfloat16")[0]
  backends = ["xla"] if args.small else [backend] + (["xla"] if args.compare_xla and backend != "xla" else [])
  for b in backends:  # a backend the sort dispatch cannot run (padded) is a usage error, before anything runs
    try:
      make_config(shape, b, 0)
    except Exception as e:
      ap.error(f"--backend {b}: {e}")
  pads = [0, 4] if args.small else args.pad
  iters = 2 if args.small else args.iters
  args.out.mkdir(parents=True, exist_ok=True)
  results = {"machine": machine.describe(), "shape": shape, "iters": iters, "checks": [], "runs": []}
  for backend in backends:
    results["checks"] += check(shape, backend, pads, min(args.check_tokens, shape["tokens"]))
  timed = [
    (b, pad) for b in backends for pad in (pads[-1:] if args.small else pads)
  ]  # the dry run times the padded path
  for backend, pad in timed:  # every profiler trace first, then CUPTI: one CUPTI client at a time
    results["runs"].append(
      guarded(lambda: measure_trace(shape, backend, pad, iters), {"backend": backend, "pad": pad}, args.small)
    )
    (args.out / "moe_layer.json").write_text(json.dumps(results, indent=1))
  for run in [] if args.no_stages else results["runs"]:
    run["stages"] = guarded(lambda: measure_stages(shape, run["backend"], run["pad"], iters), {}, args.small)
    (args.out / "moe_layer.json").write_text(json.dumps(results, indent=1))
  (args.out / "moe_layer.json").write_text(json.dumps(results, indent=1))
  (args.out / "moe_layer.md").write_text(markdown(results))
  print(markdown(results))
  return 0 if all(c["ok"] for c in results["checks"]) else 1


if __name__ == "__main__":
  sys.exit(main())
