"""benchmarks/quant_convergence.py at a few steps: every variant trains on the same batches as the unquantised
run, and the report's gaps are those of the losses it wrote."""

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO


def test_quant_convergence_benchmark_short_run(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  args = ["--out", str(tmp_path), "--steps", "10", "--batch", "4"]
  args += ["--variant", "attention", "quantization=fp8_blockwise quantize_layers=attention"]
  proc = subprocess.run(
    [sys.executable, "benchmarks/quant_convergence.py", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  results = json.loads((tmp_path / "quant_convergence.json").read_text())
  off, fp8 = (np.array(results["runs"][n]["losses"]) for n in ("off", "attention"))
  assert off.shape == fp8.shape == (10,) and np.isfinite(off).all() and np.isfinite(fp8).all()
  assert off[0] == fp8[0] or abs(fp8[0] / off[0] - 1) < 0.02  # same initial weights and batch: fp8 rounding only
  assert not np.array_equal(off, fp8)  # the fp8 attention projections changed the numbers
  gap = fp8[-10:].mean() / off[-10:].mean() - 1
  assert f"{gap:+.2%}" in (tmp_path / "quant_convergence.md").read_text()


def test_quant_convergence_benchmark_refuses_the_reserved_name(tmp_path):
  proc = subprocess.run(
    [sys.executable, "benchmarks/quant_convergence.py", "--out", str(tmp_path), "--variant", "off", ""],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2 and "--variant names must be distinct and not 'off'" in proc.stderr
  assert not any(tmp_path.iterdir())
