"""Runs a recipe under several overrides, each in its own process, and collects the results.

  python benchmarks/train_recipe.py RECIPE.yml --variant NAME "key=value ..." [--variant ...] --out results.json

Each variant trains with `python -m MaxText.train` (fresh process: peak memory is per variant) and
contributes its summary.json (median step time, tokens/s/device, TFLOP/s/device, MFU, peak memory,
compile time) and its last log lines. The results file also records the GPU, driver and versions.
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("recipe")
  ap.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "OVERRIDES"), required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--timeout", type=float, default=540)
  args = ap.parse_args()

  # no JAX in this process: a GPU client here would hold a CUDA context and memory on the GPU the variants measure
  results = {"recipe": args.recipe, "machine": machine.describe(devices=False), "variants": {}}
  runs = Path(tempfile.mkdtemp(prefix="bench_runs_"))
  for name, overrides in args.variant:
    cmd = [
      sys.executable,
      "-m",
      "MaxText.train",
      args.recipe,
      *shlex.split(overrides),
      f"base_output_directory={runs}",
      f"run_name={name}",
    ]
    print("+", " ".join(cmd), flush=True)
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
      rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
      rc, log = (
        "timeout",
        (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""),
      )
    summary_file = runs / name / "summary.json"
    entry = {"overrides": overrides, "returncode": rc, "log_tail": log.splitlines()[-25:]}
    if summary_file.exists():
      entry["summary"] = json.loads(summary_file.read_text())
    results["variants"][name] = entry
    print("\n".join(entry["log_tail"][-6:]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))  # after each variant: partial results survive a timeout
  return 0


if __name__ == "__main__":
  sys.exit(main())
