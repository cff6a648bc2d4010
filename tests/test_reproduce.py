"""scripts/reproduce_deepseek_v3.sh --dry-run: environment check, container commands, the plan (compiled
for compile-only GPUs), the sbatch command and where results appear, without training; and a plan
that does not fit stops the procedure (exit 3) before anything is launched."""

import json
import os
import subprocess

import pytest

from conftest import REPO

needs_plugin = pytest.mark.skipif(
  not (REPO / ".venv" / "gpu-aot" / "jax_plugins").is_dir() and "MAXTEXT_GPU_AOT_SITE" not in os.environ,
  reason="CUDA plugin not installed in .venv/gpu-aot: make install",
)
# The 8-GPU proxy cut to 1 dense + 1 MoE layer and short sequences: compiles in a minute or two. (The
# optimized 671B recipe's plan is tests/test_aot.py's.)
RECIPE = "recipes/deepseek_v3_proxy_8gpu/baseline.yml"
SHALLOW = ["base_num_decoder_layers=2", "first_num_dense_layers=1", "mtp_num_layers=0", "max_target_length=256"]


def reproduce(tmp_path, *args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(REPO)}
  env.pop("CONTAINER_IMAGE", None)
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  return subprocess.run(
    ["scripts/reproduce_deepseek_v3.sh", "--dry-run", "--out", str(tmp_path), "--run-name", "r", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
  )


@needs_plugin
def test_dry_run_plans_and_prints_the_launch(tmp_path):
  r = reproduce(tmp_path, "--recipe", RECIPE, "--num-gpus", "8", "--", *SHALLOW, "steps=5")
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
  out = r.stdout
  for heading in ("== 1. environment", "== 2. container", "== 3. plan", "== 4. launch", "== 5. results"):
    assert heading in out
  assert "jax backend" in out  # the doctor ran
  assert "+ docker build -t maxtext-moe-gpu:latest ." in out or "+ podman build" in out
  assert f"enroot import -o {tmp_path}/maxtext-moe-gpu.sqsh" in out
  plan = json.loads((tmp_path / "r.plan.json").read_text())
  assert plan["fits"] and plan["num_gpus"] == 8 and plan["mesh"]["expert"] == 8
  launch = next(line for line in out.splitlines() if line.startswith("+ env RECIPE="))
  assert (
    "sbatch --nodes=1 scripts/slurm/deepseek_v3_671b.sbatch" in launch
    and "steps=5" in launch
    and "RUN_NAME=r" in launch
  )
  assert f"RECIPE={RECIPE}" in launch
  assert "(dry run: not launched)" in out
  assert f"{tmp_path}/r/" in out and "metrics.jsonl" in out


@needs_plugin
def test_a_plan_that_does_not_fit_stops_before_launch(tmp_path):
  r = reproduce(
    tmp_path, "--gpu", "h100", "--num-gpus", "8", "--launcher", "local"
  )  # the full optimized 671B on 8 H100s
  assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
  assert "error: does not fit" in r.stderr and "nothing launched" in r.stderr
  assert "== 4. launch" not in r.stdout


def test_bad_arguments_exit_2(tmp_path):
  r = reproduce(tmp_path, "--launcher", "mpi")
  assert r.returncode == 2 and r.stderr.startswith("error: --launcher must be slurm or local")
