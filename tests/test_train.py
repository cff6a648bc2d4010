"""Training: parallelism invariance on 8 CPU devices, gradient accumulation, the loss falls, run files."""

import json
import math

import jax
import numpy as np
import pytest

from MaxText.data import SyntheticData
from MaxText.sharding import make_mesh
from MaxText.train import train
from MaxText.train_step import Trainer


def _losses(cfg, devices, steps=3):
  trainer = Trainer(cfg, make_mesh(cfg.mesh, devices))
  data = SyntheticData(cfg.data, trainer.global_batch, cfg.train.max_target_length, cfg.model.vocab_size)
  state, step = trainer.init_state(), trainer.jit_step()
  out = []
  for i in range(steps):
    state, metrics = step(state, trainer.device_batch(data.batch(i)))
    out.append(float(metrics["loss"]))
  return out


SMALL = ("max_target_length=16", "steps=3", "learning_rate=1e-2", "warmup_steps_fraction=0", "remat_policy=none")


@pytest.mark.parametrize(
  "mesh",
  [
    ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    ("ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2"),
    ("ici_data_parallelism=2", "ici_fsdp_parallelism=-1", "moe_dispatch=capacity", "capacity_factor=2.0"),
  ],
)
def test_eight_devices_match_one_device(tiny_config, mesh):
  one = tiny_config(*SMALL, "per_device_batch_size=16", *mesh[2:] if "moe_dispatch=capacity" in mesh else ())
  eight = tiny_config(*SMALL, "per_device_batch_size=2", *mesh)
  reference = _losses(one, jax.devices()[:1])
  sharded = _losses(eight, jax.devices())
  np.testing.assert_allclose(sharded, reference, rtol=1e-5, atol=1e-5)
  assert reference[-1] < reference[0]


def test_gradient_accumulation_matches_one_big_batch(tiny_config):
  whole = _losses(tiny_config(*SMALL, "per_device_batch_size=4"), jax.devices()[:1])
  accumulated = _losses(
    tiny_config(*SMALL, "per_device_batch_size=4", "gradient_accumulation_steps=2"), jax.devices()[:1]
  )
  np.testing.assert_allclose(accumulated, whole, rtol=1e-5, atol=1e-5)


def test_tiny_recipe_learns_and_writes_its_run(tiny_config, tmp_path, capsys):
  cfg = tiny_config(
    "steps=80", "log_period=20", "per_device_batch_size=2", f"base_output_directory={tmp_path}", "run_name=tiny"
  )
  history = train(cfg)
  losses = [h["loss"] for h in history]
  assert len(losses) == 80 and all(math.isfinite(x) for x in losses)
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])  # from ~log(256)=5.5 to well below

  run = tmp_path / "tiny"
  assert "model_name: deepseek_v3-tiny" in (run / "config.yml").read_text()
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 20, 40, 60, 79]
  for key in (
    "loss",
    "learning_rate",
    "grad_norm",
    "step_time_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "expert_load_max",
    "expert_load_mean",
  ):
    assert all(isinstance(r[key], float) for r in rows), key
  assert rows[-1]["expert_load_mean"] == pytest.approx(
    16 * 64 * 2 / 8
  )  # 8 devices x 2 sequences  # copies per expert per layer
  assert list((run / "tensorboard").glob("events.out.tfevents.*"))
  out = capsys.readouterr().out
  assert "step    20 | loss" in out and "tok/s/dev" in out and "MFU -" in out
  with pytest.raises(Exception, match="already holds a run"):
    train(cfg)


def test_model_without_mtp_checkpoints_and_its_bias_loads_into_a_new_run(tiny_config, tmp_path):
  import jax.numpy as jnp

  from MaxText import model
  from MaxText.convert.checkpoint import load_bias

  common = (
    "steps=3",
    "per_device_batch_size=1",
    "max_target_length=16",
    "mtp_num_layers=0",
    "routed_bias_update_rate=0.01",
    f"base_output_directory={tmp_path}",
  )
  train(tiny_config(*common, "run_name=first"))
  step_dir = tmp_path / "first" / "checkpoints" / "3"
  assert step_dir.is_dir()
  cfg = tiny_config(*common)
  abstract = jax.eval_shape(lambda: model.bias_state(cfg.model, cfg.moe))
  assert set(abstract) == {"moe_layers"}  # no zero-size MTP bias to save
  bias = load_bias(step_dir, abstract)
  assert float(jnp.abs(bias["moe_layers"]).sum()) > 0  # three updates of 0.01 per expert
  history = train(tiny_config(*common, "run_name=second", f"load_parameters_path={step_dir}"))
  assert len(history) == 3


def test_relative_output_directory_checkpoints(tiny_config, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # `make train` uses base_output_directory=runs, relative to the working directory
  train(
    tiny_config(
      "steps=2", "per_device_batch_size=1", "max_target_length=16", "base_output_directory=runs", "run_name=rel"
    )
  )
  assert (tmp_path / "runs" / "rel" / "checkpoints" / "2").is_dir()


OOM = (
  "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 105.30GiB with allocator GPU_0_bfc on device 0. "
  "[executable_name='jit_step']"
)


def _out_of_memory_in(run_dir, before=lambda: None) -> str:
  """The UserError line of an out-of-memory error raised in `run_dir` (after `before`) by a fresh run."""
  from MaxText.errors import UserError
  from MaxText.train import out_of_memory_is_a_user_error

  with pytest.raises(UserError) as e:
    with out_of_memory_is_a_user_error(run_dir, fresh=True):
      before()
      raise jax.errors.JaxRuntimeError(OOM)
  return str(e.value)


def test_out_of_memory_is_one_line_and_a_fresh_run_directory_is_removed(tmp_path):
  run_dir = tmp_path / "fresh"

  def start():
    run_dir.mkdir()
    (run_dir / "config.yml").write_text("x")
    (run_dir / "metrics.jsonl").write_text("")  # the writer opened it; no step was logged

  line = _out_of_memory_in(run_dir, start)
  assert "ran out of memory (Out of memory while trying to allocate 105.30GiB" in line
  assert "per_device_batch_size" in line and "\n" not in line
  assert not run_dir.exists()  # the same run_name can be tried again


def test_out_of_memory_keeps_a_run_directory_with_steps_or_checkpoints_and_other_errors_pass(tmp_path):
  from MaxText.train import out_of_memory_is_a_user_error

  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
  _out_of_memory_in(run_dir)
  assert (run_dir / "metrics.jsonl").exists()
  saved = tmp_path / "saved"  # a checkpoint written before any step was logged (log_period > checkpoint_period)
  (saved / "checkpoints" / "5").mkdir(parents=True)
  (saved / "metrics.jsonl").write_text("")
  _out_of_memory_in(saved)
  assert (saved / "checkpoints" / "5").is_dir()
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    with out_of_memory_is_a_user_error(run_dir, fresh=True):
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")
  assert run_dir.exists()


# What an H100 printed when XLA's autotuner could not allocate any candidate's buffers while compiling (2026-12-07,
# recipes/deepseek_v3_proxy_1gpu/baseline.yml at vocab_size=129280): a NOT_FOUND error, the OOM inside.
AUTOTUNE_OOM = (
  "NOT_FOUND: Failed to get configs for: 4 out of 384 instructions. See logs for all failures. Example failure: \n"
  "All configs failed during profiling or were excluded from selection.\nFailures (3):\n"
  + "EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 14.02GiB with allocator GPU_0_bfc "
  "on device 0. [tf-allocator-allocation-error='']\n" * 3
)


def test_out_of_memory_in_autotuning_is_one_line_and_other_autotuning_failures_pass(tmp_path):
  from MaxText.errors import UserError
  from MaxText.train import out_of_memory_is_a_user_error

  run_dir = tmp_path / "fresh"
  with pytest.raises(UserError) as e:
    with out_of_memory_is_a_user_error(run_dir, fresh=True):
      run_dir.mkdir()
      raise jax.errors.JaxRuntimeError(AUTOTUNE_OOM)
  line = str(e.value)
  assert "allocate 14.02GiB with allocator GPU_0_bfc on device 0, while XLA autotuned the step's kernels" in line
  assert "per_device_batch_size" in line and "\n" not in line
  assert not run_dir.exists()
  other = "NOT_FOUND: Failed to get configs for: 1 out of 3 instructions.\nFailures (1):\nINTERNAL: ptxas error"
  with pytest.raises(jax.errors.JaxRuntimeError, match="ptxas"):
    with out_of_memory_is_a_user_error(run_dir, fresh=True):
      raise jax.errors.JaxRuntimeError(other)


def test_out_of_memory_leaves_the_run_directory_of_other_processes(tmp_path, monkeypatch):
  """Only process 0 writes metrics.jsonl: on a host with its own run directory, process 1 would see no
  logged step after any number of them, so it never removes its directory."""
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  run_dir = tmp_path / "host1"
  run_dir.mkdir()
  (run_dir / "config.yml").write_text("x")
  _out_of_memory_in(run_dir)
  assert (run_dir / "config.yml").exists()


def test_step_clock_times_a_step_whose_dispatch_blocked_when_the_dispatch_returned(monkeypatch):
  """The loop fetches step k's metrics after dispatching step k + 1. When dispatch blocks until a step has
  run (its metrics are ready as it returns), step k is timed at its own dispatch, not at that fetch: each
  step gets its own time and the last one is not near zero. A step still running at dispatch keeps being
  timed at its fetch. The host's clock is a fake one that only the simulated work advances (no wall time)."""
  import jax.numpy as jnp

  from MaxText import metrics

  now = [100.0]
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
  ready = jax.block_until_ready(jnp.float32(1.0))

  def blocking_step(seconds):  # a dispatch that returns once the step has run: ready metrics
    now[0] += seconds
    return {"loss": ready}

  clock = metrics.StepClock()
  clock.dispatched(0, blocking_step(0.5))
  clock.dispatched(1, blocking_step(0.2))  # then step 0 is fetched, then step 1 after the loop
  now[0] += 0.01  # the host's work between the dispatch and the fetch
  first, last = clock.step_time(0), clock.step_time(1)
  assert (first, last) == pytest.approx((0.5, 0.2)), (first, last)  # timed at the fetches: 0.71 and 0

  class Running:  # a leaf whose step is still on the device as its dispatch returns
    def is_ready(self):
      return False

  clock.dispatched(2, {"loss": Running()})
  now[0] += 0.3  # the fetch waits for the device
  assert clock.step_time(2) == pytest.approx(0.31)


def test_the_first_step_is_fetched_before_the_next_is_dispatched(tiny_config, tmp_path, monkeypatch, capsys):
  """A fresh executable's first step is logged before the loop fetches the next batch (and dispatches the
  next step): on a GPU its metrics became readable only once the following step had run too, which logged the
  two steps' time as ~all on step 0 and ~10 ms on step 1. Later steps stay fetched one step late, after the
  next dispatch (the device never waits for the host)."""
  import MaxText.train as train_module

  real_next_batch = train_module.next_batch

  def next_batch(trainer, data, step):
    print(f"NEXT BATCH {step}", flush=True)
    return real_next_batch(trainer, data, step)

  monkeypatch.setattr(train_module, "next_batch", next_batch)
  cfg = tiny_config("steps=4", "log_period=1", f"base_output_directory={tmp_path}", "run_name=order")
  train(cfg)
  lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("step ", "NEXT BATCH"))]
  events = [
    (
      "batch" if line.startswith("NEXT") else "log",
      int(line.split()[-1] if line.startswith("NEXT") else line.split()[1]),
    )
    for line in lines
  ]
  assert events == [
    ("batch", 0),
    ("log", 0),  # before step 1's batch and dispatch: fetched at once
    ("batch", 1),
    ("batch", 2),
    ("batch", 3),
    ("log", 1),  # after step 2's dispatch: one step late
    ("log", 2),
    ("log", 3),
  ], events
