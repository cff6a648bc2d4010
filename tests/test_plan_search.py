"""`python -m MaxText.aot --search` (MaxText/plan/search.py) ranks the 671B's mesh shapes, remat and batch for
128 GPUs by the analytic estimate (`--search-budget 0`: nothing compiled, so this stays cheap), and the
planner's report carries the prediction for a small compiled step."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

PLUGIN_SITE = REPO / ".venv" / "gpu-aot"
needs_plugin = pytest.mark.skipif(
  not (PLUGIN_SITE / "jax_plugins").is_dir() and "MAXTEXT_GPU_AOT_SITE" not in os.environ,
  reason=f"CUDA plugin not installed in {PLUGIN_SITE}: make install",
)


def aot(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(REPO)}
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  return subprocess.run(
    [sys.executable, "-m", "MaxText.aot", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
  )


@needs_plugin
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_search_ranks_fitting_671b_configurations_for_128_gpus(gpu, tmp_path):
  out = tmp_path / "search.json"
  proc = aot(
    "recipes/deepseek_v3_671b/optimized.yml", "--gpu", gpu, "--num-gpus", "128", "--search", "--search-budget", "0",
    "--json", str(out),
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "best by estimate (not compiled): ici_expert_parallelism=" in proc.stdout
  rows = json.loads(out.read_text())["search"]
  fits = [r for r in rows if r["est_fits"]]
  assert fits and rows[0]["est_fits"] and all(r["est_peak_gib"] > 0 for r in rows)
  ranked = [r["est_tokens_per_s_per_gpu"] for r in fits]
  assert ranked == sorted(ranked, reverse=True)
  assert all(r["ici_expert_parallelism"] * r["ici_fsdp_parallelism"] * r["ici_data_parallelism"] == 128 for r in rows)
