"""Faults, end to end through `python -m MaxText.train` on a packed JSON-lines dataset:
SIGKILL mid-training then resume gives bit-for-bit the loss sequence of an uninterrupted run;
SIGTERM saves a checkpoint and exits 143, and the run resumes from it; a run continued in parts
without the final save matches the uninterrupted one; an injected NaN stops
the run (exit 1) with the last checkpoint intact, and nan_policy=skip resumes past it.

The runs share a persistent compilation cache, so only the first one compiles the step.
"""

import json
import re
import signal
import subprocess
import sys

import pytest

import data_builders as build
from conftest import REPO, TINY_RECIPE

STEPS = 24
PERIOD = 4


def child_env(d):
  """A trainer subprocess's whole environment: CPU, this checkout, a compilation cache under `d`."""
  return {
    "PATH": "/usr/bin:/bin",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(REPO),
    "JAX_COMPILATION_CACHE_DIR": str(d / "jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }


def dataset_env(d) -> dict:
  """A packed JSON-lines dataset, its word tokenizer and a trainer subprocess's environment, all under `d`."""
  docs = build.corpus(60)
  return {
    "dir": d,
    "data": str(build.write_jsonl(d / "docs.jsonl", docs)),
    "tokenizer": str(build.word_tokenizer(d / "tokenizer.json", docs)),
    "vars": child_env(d),
  }


def train_args(env, run_name, *overrides) -> list[str]:
  """`python -m MaxText.train` arguments: the tiny recipe on env's dataset, run `run_name`, then `overrides`."""
  return [
    str(TINY_RECIPE),
    "dataset_type=grain",
    "grain_file_type=jsonl",
    f"grain_train_files={env['data']}",
    "tokenizer_type=huggingface",
    f"tokenizer_path={env['tokenizer']}",
    "packing=true",
    f"base_output_directory={env['dir'] / 'runs'}",
    f"run_name={run_name}",
    *overrides,
  ]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return dataset_env(tmp_path_factory.mktemp("faults"))


def args(env, run_name, *overrides):
  return train_args(
    env,
    run_name,
    "per_device_batch_size=4",
    "max_target_length=32",
    "remat_policy=none",
    "enable_tensorboard=false",
    f"steps={STEPS}",
    f"checkpoint_period={PERIOD}",
    "log_period=1",
    "compile_heartbeat_seconds=0",
    f"learning_rate_schedule_steps={STEPS}",  # a schedule independent of steps: one compiled step for all runs
    *overrides,
  )


def train_cmd(*argv):
  return [sys.executable, "-m", "MaxText.train", *argv]


def run(env, argv, cmd=None):
  return subprocess.run(cmd or train_cmd(*argv), cwd=REPO, env=env["vars"], capture_output=True, text=True, timeout=600)


def start(env, argv):
  return subprocess.Popen(
    train_cmd(*argv), cwd=REPO, env=env["vars"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def wait_for_step(proc, step: int) -> list[str]:
  """Reads the run's log until it reports `step`; returns the lines read."""
  lines = []
  for line in proc.stdout:
    lines.append(line)
    m = re.match(r"step\s+(\d+) \|", line)
    if m and int(m.group(1)) >= step:
      return lines
  raise AssertionError("the run ended before step %d:\n%s\n%s" % (step, "".join(lines), proc.stderr.read()))


def metrics(env, run_name) -> dict[int, dict]:
  """step -> its metrics; a step logged twice (re-run after a resume) keeps its last line."""
  rows = [json.loads(line) for line in (env["dir"] / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r for r in rows}


def checkpoints(env, run_name) -> list[int]:
  return sorted(int(p.name) for p in (env["dir"] / "runs" / run_name / "checkpoints").iterdir() if p.name.isdigit())


def test_sigkill_then_resume_matches_an_uninterrupted_run_bitwise(env):
  ref = run(env, args(env, "reference"))
  assert ref.returncode == 0, ref.stderr
  reference = metrics(env, "reference")
  assert sorted(reference) == list(range(STEPS))

  proc = start(env, args(env, "killed"))
  wait_for_step(proc, 10)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert metrics(env, "killed").keys() != reference.keys()  # it really stopped part-way

  resumed = run(env, args(env, "killed"))
  assert resumed.returncode == 0, resumed.stderr
  m = re.search(r"resumed from checkpoint \S+ \(step (\d+)\)", resumed.stdout)
  assert m and 0 < int(m.group(1)) < STEPS and int(m.group(1)) % PERIOD == 0, resumed.stdout
  after = metrics(env, "killed")
  assert sorted(after) == list(range(STEPS))
  for key in ("loss", "grad_norm", "expert_load_max", "mtp_loss"):
    assert [after[s][key] for s in range(STEPS)] == [reference[s][key] for s in range(STEPS)], key  # exact, not approx


def test_sigterm_saves_a_checkpoint_exits_143_and_resumes(env):
  proc = start(env, args(env, "preempted", "steps=1000", "checkpoint_period=1000"))
  wait_for_step(proc, 5)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err
  assert "Traceback" not in err
  m = re.search(r"SIGTERM: stopped after step (\d+); checkpoint saved at step (\d+) in ", out)
  assert m and int(m.group(2)) == int(m.group(1)) + 1, out
  saved = int(m.group(2))
  assert checkpoints(env, "preempted") == [saved]  # not a multiple of checkpoint_period: saved for the signal
  assert (
    json.loads((env["dir"] / "runs" / "preempted" / "summary.json").read_text())["stopped"]
    == f"SIGTERM at step {saved}"
  )

  again = run(env, args(env, "preempted", f"steps={saved + 2}", "checkpoint_period=1000"))
  assert again.returncode == 0, again.stderr
  assert f"(step {saved})" in again.stdout and max(metrics(env, "preempted")) == saved + 1


def test_a_run_continued_in_parts_without_the_final_save_matches_the_uninterrupted_one(env):
  # save_checkpoint_on_completion=false: the first part leaves only its periodic checkpoint, the second resumes
  # from it (what a disk with room for one checkpoint of a large model needs); the losses are the reference's.
  first = run(env, args(env, "parts", "steps=6", "save_checkpoint_on_completion=false"))
  assert first.returncode == 0, first.stderr
  assert checkpoints(env, "parts") == [PERIOD]  # step 6 is the end, not a multiple of the period: not saved
  second = run(env, args(env, "parts", "steps=10", "save_checkpoint_on_completion=false"))
  assert second.returncode == 0, second.stderr
  assert f"(step {PERIOD})" in second.stdout
  assert checkpoints(env, "parts") == [PERIOD, 2 * PERIOD]
  reference = run(env, args(env, "parts-reference", "steps=10", "enable_checkpointing=false"))
  assert reference.returncode == 0, reference.stderr
  parts, whole = metrics(env, "parts"), metrics(env, "parts-reference")
  assert sorted(parts) == sorted(whole) == list(range(10))
  assert [parts[s]["loss"] for s in range(10)] == [whole[s]["loss"] for s in range(10)]  # exact


POISONED = """
import os, sys
import numpy as np
from MaxText import train, train_step
calls = {{"n": 0}}
real = train_step.Trainer.device_batch
def device_batch(self, host_batch):
  calls["n"] += 1
  if calls["n"] == {poison_call}:  # make this step's loss weights NaN: loss and gradients go NaN
    host_batch = host_batch._replace(mask=host_batch.mask * np.float32("nan"))
  return real(self, host_batch)
train_step.Trainer.device_batch = device_batch
sys.exit(train.main({argv!r}))
"""


def test_nan_stops_with_the_last_checkpoint_intact_and_skip_goes_past_it(env):
  # batch k (counting from 1) feeds step k-1: poison step 6; checkpoints every 4 steps
  stopped = run(env, None, cmd=[sys.executable, "-c", POISONED.format(poison_call=7, argv=args(env, "nan"))])
  assert stopped.returncode == 1, stopped.stderr
  last = stopped.stderr.strip().splitlines()[-1]
  assert re.fullmatch(
    r"error: step 6: loss nan, grad norm nan: not finite; stopped \(nan_policy=stop\); "
    r"the last checkpoint is step 4 in \S+\. "
    r"Resume from it with a lower learning_rate, or set nan_policy=skip",
    last,
  ), last
  assert checkpoints(env, "nan") == [4]

  # The step-4 checkpoint still loads and trains; with nan_policy=skip the poisoned step 6 leaves the state unchanged.
  skipped = run(
    env,
    None,
    cmd=[sys.executable, "-c", POISONED.format(poison_call=3, argv=args(env, "nan", "steps=10", "nan_policy=skip"))],
  )
  assert skipped.returncode == 0, skipped.stderr
  assert "(step 4)" in skipped.stdout
  assert (
    "step 6: loss nan, grad norm nan: not finite; step skipped, state unchanged (nan_policy=skip)" in skipped.stdout
  )
  rows = metrics(env, "nan")
  assert rows[6]["nonfinite"] == 1 and all(rows[s]["nonfinite"] == 0 for s in (4, 5, 7, 8, 9))
  assert all(rows[s]["loss"] == rows[s]["loss"] for s in (7, 8, 9))  # finite again after the skipped step
  assert checkpoints(env, "nan")[-1] == 10
