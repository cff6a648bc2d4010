"""Multi-process launch (MaxText/distributed.py, scripts/launch_local.sh): where a process finds its
coordinator, count and id under SLURM, Kubernetes and explicit variables; and 2 local CPU processes
(gloo collectives) train to the same losses as 1 process over the same global batch."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY_RECIPE
from MaxText import distributed
from MaxText.errors import UserError


def test_no_launcher_is_single_process():
  assert distributed.detect({}) == distributed.Launch("single")
  # The batch script of an sbatch job (no srun step) runs once, whatever SLURM_NTASKS says.
  assert distributed.detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_PROCID": "0"}).source == "single"


def test_explicit_variables():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
  assert distributed.detect(env) == distributed.Launch("explicit", "10.0.0.1:1234", 4, 3)


@pytest.mark.parametrize(
  "env, message",
  [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "not JAX_PROCESS_ID"),
    (
      {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
      "must be in [0, JAX_NUM_PROCESSES=2)",
    ),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "must be an integer"),
    ({"JOB_COMPLETION_INDEX": "1"}, "JAX_NUM_PROCESSES is not"),
  ],
)
def test_bad_environment_is_one_clear_error(env, message):
  with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
    distributed.detect(env)


def test_slurm_srun_step():
  env = {
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "5",
    "SLURM_STEP_NUM_TASKS": "16",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_NODELIST": "gpu[012-015,020],cpu1",
    "SLURM_STEP_TASKS_PER_NODE": "1(x16)",
  }
  launch = distributed.detect(env)
  assert launch == distributed.Launch("slurm", f"gpu012:{20000 + 123456 % 40000}", 16, 5, None)
  # one task per GPU: each task pinned to its local GPU
  env.update(
    SLURM_STEP_NUM_TASKS="128",
    SLURM_PROCID="9",
    SLURM_LOCALID="1",
    SLURM_STEP_TASKS_PER_NODE="8(x16)",
    JAX_COORDINATOR_PORT="4000",
  )
  assert distributed.detect(env) == distributed.Launch("slurm", "gpu012:4000", 128, 9, (1,))


def test_first_host_of_slurm_node_lists():
  assert distributed.first_host("node7") == "node7"
  assert distributed.first_host("a-b[3,5-9]") == "a-b3"
  assert distributed.first_host("gpu[0010-0013],x") == "gpu0010"


def test_kubernetes_indexed_job_and_jobset():
  env = {"JOB_COMPLETION_INDEX": "3", "JAX_NUM_PROCESSES": "16"}
  assert distributed.detect(env, fqdn="train-3.train-svc.ml.svc.cluster.local") == distributed.Launch(
    "kubernetes", "train-0.train-svc.ml.svc.cluster.local:8476", 16, 3
  )
  jobset = distributed.detect(env, fqdn="dsv3-workers-0-3.dsv3")
  assert jobset.coordinator == "dsv3-workers-0-0.dsv3:8476" and jobset.process_id == 3
  with pytest.raises(UserError, match="does not end in -3"):
    distributed.detect(env, fqdn="somehost.local")
  explicit = distributed.detect({**env, "JAX_COORDINATOR_ADDRESS": "leader:99"}, fqdn="whatever")
  assert explicit == distributed.Launch("kubernetes", "leader:99", 16, 3)


def _losses(run_dir) -> list[float]:
  return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_give_the_losses_of_one(tmp_path):
  # 8 CPU devices either way: one process with 8, or two with 4 each; the same fsdp=8 mesh and global batch.
  overrides = [
    "steps=3",
    "log_period=1",
    "per_device_batch_size=1",
    "max_target_length=16",
    "mtp_num_layers=0",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "compile_heartbeat_seconds=0",
    f"base_output_directory={tmp_path}",
  ]
  base_env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "JOB_COMPLETION"))}
  base_env["JAX_PLATFORMS"] = "cpu"
  one = subprocess.run(
    [sys.executable, "-m", "MaxText.train", str(TINY_RECIPE), *overrides, "run_name=one"],
    cwd=REPO,
    env={**base_env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
  assert "launch: single process" in one.stdout
  two = subprocess.run(
    ["scripts/launch_local.sh", "2", str(TINY_RECIPE), *overrides, "run_name=two"],
    cwd=REPO,
    env={**base_env, "PYTHON": sys.executable, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-2000:]
  assert "[0] launch: process 0 of 2 (explicit)" in two.stdout and "[1] launch: process 1 of 2 (explicit)" in two.stdout
  assert "[0] devices: 8 x cpu (cpu), 2 process(es)" in two.stdout
  a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert len(a) == len(b) == 3
  # Same data, same mesh; only the all-reduce order may differ (gloo across processes vs in-process).
  assert b == pytest.approx(a, rel=1e-5, abs=0)
  assert a[0] != a[2]  # it trained
