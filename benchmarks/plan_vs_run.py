"""How close the planner (python -m MaxText.aot) comes to a real run: plan each recipe for the GPU
here, train it for a few steps, and compare planned against measured peak memory and step time.

  python3 benchmarks/plan_vs_run.py --out DIR [--recipe R ...] [--steps 8] [--gpu h200]
  python3 benchmarks/plan_vs_run.py --out DIR --cpu-dry-run     # the tiny recipe on CPU (checks the script)

Writes DIR/plan_vs_run.json and DIR/plan_vs_run.md. The plan runs in its own process on the CPU
(compile-only GPUs), the training run in another on the GPU; each row gives the planned peak and
lower-bound step time beside the measured peak memory and median step time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPES = ["recipes/deepseek_v3_proxy_1gpu/baseline.yml", "recipes/deepseek_v3_proxy_1gpu/optimized.yml"]


def run(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
  print("+", " ".join(cmd), flush=True)
  try:
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr
  except subprocess.TimeoutExpired:
    return -1, "timeout"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--recipe", action="append")
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--gpu", default="h200")
  ap.add_argument("--timeout", type=float, default=900)
  ap.add_argument("--cpu-dry-run", action="store_true")
  args = ap.parse_args()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  recipes = args.recipe or (["recipes/deepseek_v3_tiny.yml"] if args.cpu_dry_run else DEFAULT_RECIPES)
  extra = ["per_device_batch_size=2"] if args.cpu_dry_run else []
  runs = Path(tempfile.mkdtemp(prefix="plan_vs_run_"))
  rows = []
  for recipe in recipes:
    name = Path(recipe).parent.name + "-" + Path(recipe).stem
    plan_json = out / f"{name}.plan.json"
    plan_env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    rc, log = run(
      [
        sys.executable,
        "-m",
        "MaxText.aot",
        recipe,
        "--gpu",
        args.gpu,
        "--num-gpus",
        "1",
        "--json",
        str(plan_json),
        *extra,
      ],
      plan_env,
      args.timeout,
    )
    row = {"recipe": recipe, "plan_returncode": rc, "plan_log_tail": log.splitlines()[-14:]}
    if plan_json.exists():
      plan = json.loads(plan_json.read_text())
      row.update(
        planned_peak_gib=plan["memory"]["peak"] / 2**30,
        planned_fits=plan["fits"],
        lower_bound_step_s=(plan.get("lower_bound_step_s") or {}).get("step"),
      )
    train_env = {**os.environ, **({"JAX_PLATFORMS": "cpu"} if args.cpu_dry_run else {})}
    rc, log = run(
      [
        sys.executable,
        "-m",
        "MaxText.train",
        recipe,
        f"steps={args.steps}",
        "enable_checkpointing=false",
        f"base_output_directory={runs}",
        f"run_name={name}",
        *extra,
      ],
      train_env,
      args.timeout,
    )
    row.update(train_returncode=rc, train_log_tail=log.splitlines()[-8:])
    summary = runs / name / "summary.json"
    if summary.exists():
      s = json.loads(summary.read_text())
      row.update(measured_peak_gib=s.get("peak_memory_gib"), median_step_time_s=s.get("median_step_time_s"))
    rows.append(row)
    (out / "plan_vs_run.json").write_text(json.dumps(rows, indent=1))  # after each recipe: partial results survive

  def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"

  lines = [
    "| recipe | planned peak GiB | measured peak GiB | planned/measured | step >= (plan) s | median step s |",
    "|---|---|---|---|---|---|",
  ]
  for r in rows:
    ratio = (
      r["planned_peak_gib"] / r["measured_peak_gib"]
      if r.get("planned_peak_gib") and r.get("measured_peak_gib")
      else None
    )
    lines.append(
      f"| {r['recipe']} | {fmt(r.get('planned_peak_gib'), '.1f')} | {fmt(r.get('measured_peak_gib'), '.1f')} "
      f"| {fmt(ratio, '.2f')} "
      f"| {fmt(r.get('lower_bound_step_s'), '.3f')} | {fmt(r.get('median_step_time_s'), '.3f')} |"
    )
  (out / "plan_vs_run.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0 if all(r["plan_returncode"] in (0, 3) and r["train_returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
