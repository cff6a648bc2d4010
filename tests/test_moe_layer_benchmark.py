"""benchmarks/moe_layer.py --small: the GPU benchmark's whole path (float32 check, profiler-trace
attribution to named scopes, per-stage timing, JSON + markdown) runs on the CPU at tiny shapes."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_moe_layer_benchmark_dry_run(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run(
    [sys.executable, "benchmarks/moe_layer.py", "--small", "--out", str(tmp_path)],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  results = json.loads((tmp_path / "moe_layer.json").read_text())
  assert [c["pad"] for c in results["checks"]] == [0, 4] and all(c["ok"] and c["finite"] for c in results["checks"])
  (run,) = results["runs"]
  for mode in ("fwd", "fwd+bwd"):
    trace = run["trace"][mode]
    assert trace["runs_found"] == results["iters"]
    for stage in ("router", "permute", "gmm", "combine", "shared_experts"):
      assert trace[stage] > 0, (mode, stage, trace)  # every scope found in the trace
    assert trace["total"] >= sum(trace[s] for s in ("router", "permute", "gmm", "combine", "shared_experts"))
    assert trace["layer_over_gmm"] == trace["total"] / trace["gmm"]
    top = trace["top_ops"]["permute"]  # the stage's longest ops, longest first, within the stage's time
    assert top and all(ms > 0 for _, ms in top) and [ms for _, ms in top] == sorted((ms for _, ms in top), reverse=True)
    assert top[0][1] <= trace["permute"] + 1e-4  # each op is part of its stage in every run
  assert set(run["stages"]) == {"router", "permute", "gmm", "combine", "shared_experts", "layer"}
  assert "| xla | 4 | fwd+bwd |" in (tmp_path / "moe_layer.md").read_text()
