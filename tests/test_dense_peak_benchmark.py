"""benchmarks/dense_peak.py on the CPU at small shapes: each GEMM checked against float32, the peak is the
fastest shape's rate, and a bad shape is one error line."""

import json
import os
import subprocess
import sys

from conftest import REPO


def run(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  return subprocess.run(
    [sys.executable, "benchmarks/dense_peak.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )


def test_dense_peak_on_cpu(tmp_path):
  proc = run("--out", str(tmp_path), "--shapes", "128,256x128x64", "--iters", "2")
  assert proc.returncode == 0, proc.stderr[-2000:]
  results = json.loads((tmp_path / "dense_peak.json").read_text())
  assert [r["shape"] for r in results["rows"]] == ["128x128x128", "256x128x64"]
  assert all(r["ok"] and r["rel_err"] < 1e-2 and r["tflops"] > 0 for r in results["rows"])
  assert results["measured_peak_tflops"] == max(r["tflops"] for r in results["rows"])


def test_bad_shape_is_one_error_line(tmp_path):
  proc = run("--out", str(tmp_path), "--shapes", "128x64")
  assert proc.returncode == 2 and "--shapes 128x64: comma-separated N or MxKxN" in proc.stderr
  assert not any(tmp_path.iterdir())
