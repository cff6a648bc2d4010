"""batch_size_schedule (MaxText/schedules.py BatchSizes): the global batch over the run in whole microbatches,
its tokens counted exactly on the host, DeepSeek-V3's ramp (section 4.2) in the pretrain recipe; a run
stopped and resumed mid-ramp, before and after a change, continues an uninterrupted run bit for bit; the
per-step data wait is in the log line, metrics.jsonl and TensorBoard."""

import json
import math
import struct
from fractions import Fraction

import jax
import numpy as np
import pytest

import test_faults as faults
from conftest import REPO, TINY_RECIPE
from MaxText import schedules
from MaxText.config import load_config
from MaxText.errors import UserError

PRETRAIN = REPO / "recipes" / "deepseek_v3_671b" / "pretrain.yml"
B, T = 10**9, 10**12


def brute_force(segments, micro, seq_len, steps):
  """Microbatches per step, walked one step at a time in exact fractions: the value of the segment in force
  at the tokens (or steps) seen, rounded down to whole microbatches, at least one. segments: (shape, value,
  end, unit) with `end` counted from the start of the run; a linear segment starts where the one before
  ended (0 before the first)."""
  counts, seen, value, start = [], 0, 0, {"steps": 0, "tokens": 0}
  i = 0
  for step in range(steps):
    while i < len(segments) and (step if segments[i][3] == "steps" else seen) >= segments[i][2]:
      start = {"steps": step, "tokens": segments[i][2] if segments[i][3] == "tokens" else seen}
      value = segments[i][1]
      i += 1
    if i == len(segments):
      v = Fraction(value)
    else:
      shape, v1, end, unit = segments[i]
      pos = step if unit == "steps" else seen
      length = end - start[unit]
      v = Fraction(v1) if shape == "constant" else value + (v1 - value) * Fraction(pos - start[unit], length)
    counts.append(max(1, math.floor(v / micro)))
    seen += counts[-1] * micro * seq_len
  return counts


def test_the_papers_ramp_counted_exactly():
  """3,072 -> 15,360 sequences over the first 469B tokens in microbatches of 128 sequences (one per GPU
  of 128) of 4,096 tokens, against a step-by-step walk in fractions."""
  ramp = schedules.BatchSizes(
    "batch_size_schedule", "3072 for 0 tokens; linear 15360 until 469B; 15360", 128, 120, 4096
  )
  end = ramp.runs[-1][0]  # the first step at 15,360
  want = brute_force([("constant", 3072, 0, "tokens"), ("linear", 15360, 469 * B, "tokens")], 128, 4096, end + 2)
  assert [ramp.microbatches(s) for s in range(end + 2)] == want
  assert want[0] == 24 and want[end - 1] == 119 and want[end] == want[end + 1] == 120
  # Tokens before a step: the sum of the steps before it, in integers (beyond float64's 2^53 too).
  assert ramp.tokens.before(end) == sum(want[:end]) * 128 * 4096 >= 469 * B > ramp.tokens.before(end - 1)
  far = 10**9
  assert ramp.tokens.before(far) == ramp.tokens.before(end) + (far - end) * 15360 * 4096
  for tokens in (1, 469 * B, 10 * T, 14_800 * B, 10**17 + 1):
    s = ramp.tokens.first_step_with(tokens)
    assert ramp.tokens.before(s) >= tokens > ramp.tokens.before(s - 1)
  assert len(ramp.runs) == 97  # one run per microbatch count 24..120: 97 compiled steps at most


def test_steps_tokens_and_falling_ramps_match_a_step_by_step_walk():
  micro, seq = 2, 5  # 10 tokens per microbatch, at most 8 microbatches
  first = schedules.BatchSizes("b", "linear 12 for 7 steps; 4 for 3 steps; linear 2 until 900 tokens", micro, 8, seq)
  second = schedules.BatchSizes(
    "b", "10 for 100 tokens; linear 2 for 500 tokens; linear 16 for 20 steps; 6", micro, 8, seq
  )
  at_600 = second.tokens.first_step_with(600)  # where the segment in steps starts
  # The same segments with their ends counted from the start of the run, as the walk reads them.
  cases = {
    first: [("linear", 12, 7, "steps"), ("constant", 4, 10, "steps"), ("linear", 2, 900, "tokens")],
    second: [("constant", 10, 100, "tokens"), ("linear", 2, 600, "tokens"), ("linear", 16, at_600 + 20, "steps")]
    + [("constant", 6, 10**9, "steps")],
  }
  for ramp, segments in cases.items():
    want = brute_force(segments, micro, seq, 150)
    assert [ramp.microbatches(s) for s in range(150)] == want
    assert all(ramp.tokens.before(s) == sum(want[:s]) * micro * seq for s in range(151))
  assert first.microbatches(0) == 1 and first.microbatches(6) == 5 and first.microbatches(149) == 1  # clamped, then 2
  # A linear segment reaches its value where it ends, where the next one takes over: 16 sequences never run.
  assert max(second.microbatches(s) for s in range(150)) == 7 and second.microbatches(149) == 3


def test_token_schedules_follow_the_tokens_the_ramp_consumed():
  """A segment in tokens ends at the first step that has seen that many tokens, and its progress on device
  (float32, from the step) follows the exact count on the host, inside the ramp and after it."""
  ramp = schedules.BatchSizes("b", "16 for 0 tokens; linear 64 until 20000 tokens; 64", 8, 8, 10)
  lr = schedules.Schedule("lr", "linear 1 for 7000 tokens; cosine 0.1 until 30000 tokens; 0.05", ramp.tokens)
  seen = [ramp.tokens.before(s) for s in range(200)]
  assert lr.phases[0].end_step == next(s for s in range(200) if seen[s] >= 7000)
  assert lr.phases[1].end_step == next(s for s in range(200) if seen[s] >= 30000)
  fn = jax.jit(lr)
  device = [float(fn(np.int32(s))) for s in range(200)]
  for s in range(200):
    if seen[s] < 7000:
      host = seen[s] / 7000
    elif seen[s] < 30000:
      host = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (seen[s] - 7000) / 23000))
    else:
      host = 0.05
    assert device[s] == pytest.approx(host, rel=2e-6, abs=1e-7), s
    assert lr.at(s) == pytest.approx(host, rel=1e-12), s


@pytest.fixture(scope="module")
def pretrain():
  return load_config(PRETRAIN)


def test_the_recipe_ramps_as_the_paper_and_trains_14_8t_tokens(pretrain):
  t = pretrain.train
  micro = t.per_device_batch_size // t.gradient_accumulation_steps * 128  # on the recipe's 128 GPUs
  ramp = schedules.BatchSizes("batch_size_schedule", t.batch_size_schedule, micro, t.gradient_accumulation_steps, 4096)
  end = ramp.runs[-1][0]
  assert (ramp.sequences(0), ramp.sequences(end - 1), ramp.sequences(end)) == (3072, 15232, 15360)
  assert ramp.tokens.before(end - 1) < 469 * B <= ramp.tokens.before(end)
  # The run ends at the first step that has seen 14.8T tokens.
  assert ramp.tokens.before(t.steps - 1) < 14_800 * B <= ramp.tokens.before(t.steps)
  # The paper's token boundaries under the ramp: MTP weight 0.1 from 10T, bias speed 0 from 14.3T.
  mtp = schedules.Schedule("mtp_loss_scaling_factor", t.mtp_loss_scaling_factor_schedule, ramp.tokens)
  at_10t = ramp.tokens.first_step_with(10 * T)
  assert ramp.tokens.before(at_10t - 1) < 10 * T <= ramp.tokens.before(at_10t)
  fn = jax.jit(mtp)
  assert [float(fn(np.int32(s))) for s in (0, at_10t - 1, at_10t)] == [
    np.float32(0.3),
    np.float32(0.3),
    np.float32(0.1),
  ]
  bias = schedules.Schedule("routed_bias_update_rate", t.routed_bias_update_rate_schedule, ramp.tokens)
  assert bias.phases[0].end_step == ramp.tokens.first_step_with(14_300 * B)


@pytest.mark.parametrize(
  "value, message",
  [
    ("cosine 64 for 10 steps", "use constant or linear"),
    ("16.5 for 10 steps; 64", "not a whole, positive number of sequences"),
    ("64 until 2T; 16 until 1T", "ends before the segment starts"),
    ("64 for 10", "needs a unit"),
  ],
)
def test_a_bad_batch_size_schedule_is_one_config_error(tiny_config, value, message):
  with pytest.raises(UserError, match=f"^batch_size_schedule: .*{message}.*set in the command line"):
    tiny_config("gradient_accumulation_steps=2", f"batch_size_schedule={value}")


def test_batches_the_mesh_cannot_run_are_refused_before_anything_runs(tiny_config):
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  # 8 devices x 4 sequences in 2 microbatches: microbatches of 16 sequences, at most 32 a step.
  for value, message in (("24 for 2 steps; 32", "24 sequences is not a whole number of microbatches of 16"),
                         ("16 for 2 steps; 48", "48 sequences is not a whole number")):  # fmt: skip
    cfg = tiny_config("per_device_batch_size=4", "gradient_accumulation_steps=2", f"batch_size_schedule={value}")
    with pytest.raises(UserError, match=message):
      Trainer(cfg, make_mesh(cfg.mesh))


def test_the_gradient_sum_in_host_memory_keeps_the_numerics(tiny_config):
  """gradient_accumulation_host_offload (the pretrain recipe's) makes the same float32 additions in the same
  order, the sum copied to pinned host memory and back between them. The barrier that orders the copy lets
  XLA fuse the gradient's own computation differently (the embedding's scatter-add), so the updated
  parameters agree to float32 rounding, not always to the bit."""
  from MaxText.data import make_iterator
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  common = ("per_device_batch_size=2", "gradient_accumulation_steps=2", "max_target_length=32", "remat_policy=none")
  common += (
    "base_num_decoder_layers=2",
    "mtp_num_layers=0",
    "learning_rate_schedule=phases",
    "learning_rate_phases=constant 1e-2",
  )
  initial, results = None, []
  for offload in ("false", "true"):
    cfg = tiny_config(*common, f"gradient_accumulation_host_offload={offload}")
    trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:4]))  # fsdp over 4 devices: a sharded sum
    initial = initial or jax.device_get(trainer.init_state())
    state = jax.device_put(initial, trainer.state_shardings)
    data = make_iterator(cfg.data, local_batch=8, global_batch=8, seq_len=32, vocab_size=cfg.model.vocab_size)
    batch = trainer.device_batch(next(data))
    lowered = trainer.jit_step().lower(state, batch)
    placements = lowered.as_text().count("annotate_device_placement")
    assert (placements > 0) == (offload == "true")  # the copies to and from host memory are in the step
    state, metrics = lowered.compile()(state, batch)
    results.append((float(metrics["loss"]), [np.asarray(x) for x in jax.tree.leaves(state.params)]))
  (plain_loss, plain), (offloaded_loss, offloaded) = results
  assert plain_loss == offloaded_loss
  assert any(not np.array_equal(a, b) for a, b in zip(plain, jax.tree.leaves(initial.params)))  # it trained
  for a, b in zip(plain, offloaded):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_gradient_sum_offload_needs_a_sum(tiny_config):
  with pytest.raises(UserError, match="^gradient_accumulation_host_offload: there is no gradient sum"):
    tiny_config("gradient_accumulation_host_offload=true")


# ---- end to end through `python -m MaxText.train` on one CPU device, packed JSON-lines documents ----
# 8 sequences x 16 tokens a step at most, in 2 microbatches of 4 (64 tokens each). The batch ramps from 4
# to 8 sequences over the first 192 tokens: steps 0-2 run one microbatch, step 3 on two (tokens seen
# before steps 0..6: 0, 64, 128, 192, 320, 448, 576). The learning rate's segments are in tokens: a
# warmup over 256 tokens (to step 4) and a cosine over the next 256 (steps 4-5), then 5e-4 from step 6.
RAMP = (
  "per_device_batch_size=8",
  "gradient_accumulation_steps=2",
  "max_target_length=16",
  "batch_size_schedule=4 for 0 tokens; linear 8 until 192 tokens; 8",
  "learning_rate_schedule=phases",
  "learning_rate_phases=linear 1e-2 for 256 tokens; cosine 1e-3 for 256 tokens; 5e-4",
  "base_num_decoder_layers=2",  # one dense layer, one MoE layer, the MTP module: less to compile
  "remat_policy=none",
  "compile_heartbeat_seconds=0",
  "log_period=1",
  "async_checkpointing=false",
  "checkpoint_period=1",
  "max_num_checkpoints_to_keep=10",
)
STEPS = 7
SEEN = [0, 64, 128, 192, 320, 448, 576]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return faults.dataset_env(tmp_path_factory.mktemp("ramp"))


def ramp_args(env, run_name, *overrides):
  return faults.train_args(env, run_name, *RAMP, *overrides)


def train_run(env, run_name, *overrides):
  done = faults.run(env, ramp_args(env, run_name, *overrides))
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def tensorboard_scalars(directory) -> dict[str, dict[int, float]]:
  """tag -> step -> value from the TFRecord event files under `directory` (length, crc, event, crc)."""
  from tensorboardX.proto import event_pb2

  out: dict[str, dict[int, float]] = {}
  for path in directory.rglob("events.out.tfevents.*"):
    data, at = path.read_bytes(), 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
      at += 12 + length + 4
      for v in event.summary.value:
        out.setdefault(v.tag, {})[event.step] = v.simple_value
  return out


def test_resume_mid_ramp_before_and_after_a_change_matches_an_uninterrupted_run(env):
  log = train_run(env, "reference", f"steps={STEPS}", "enable_tensorboard=true")
  assert "schedule: batch_size = 4 sequences at step 0 (0 tokens): 1 microbatch(es) of 4; linear 4 -> 8" in log
  assert "schedule: batch_size 4 -> 8 sequences at step 3 (192 tokens): 2 microbatch(es) of 4; 8 to the end" in log
  assert "schedule: learning_rate 0.0075 -> 0.008682 at step 4 (320 tokens): cosine 0.01 -> 0.001" in log
  assert "schedule: learning_rate 0.002318 -> 0.0005 at step 6 (576 tokens)" in log
  reference = faults.metrics(env, "reference")
  assert sorted(reference) == list(range(STEPS))
  column = lambda m, key: [m[s][key] for s in range(STEPS)]  # noqa: E731
  assert column(reference, "batch_size") == [4, 4, 4, 8, 8, 8, 8]
  # The learning rate follows the tokens the ramp consumed (a constant 128 tokens a step would end the warmup
  # at step 2 and the cosine at step 4).
  lr = column(reference, "learning_rate")
  assert lr[0] == 0.0 and lr[1:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3], rel=1e-6)
  for s in (4, 5):
    assert lr[s] == pytest.approx(1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * (SEEN[s] - 256) / 256)), rel=1e-6)
  assert lr[6] == np.float32(5e-4)
  # The data wait: in every step's metrics (never negative), the log line and TensorBoard.
  assert all(w >= 0 for w in column(reference, "data_wait_s"))
  assert all(" | data " in line for line in log.splitlines() if line.startswith("step "))
  scalars = tensorboard_scalars(env["dir"] / "runs" / "reference" / "tensorboard")
  assert sorted(scalars["data_wait_s"]) == list(range(STEPS)) and min(scalars["data_wait_s"].values()) >= 0
  assert [scalars["batch_size"][s] for s in range(STEPS)] == [4, 4, 4, 8, 8, 8, 8]

  # Stopped at step 2 (one microbatch, before the batch grows), then at step 4 (just after it grew), resumed.
  train_run(env, "resumed", "steps=2")
  log = train_run(env, "resumed", "steps=4")
  assert "(step 2)" in log and "schedule: batch_size 4 -> 8 sequences at step 3" in log
  log = train_run(env, "resumed", f"steps={STEPS}")
  assert "(step 4)" in log and "schedule: batch_size = 8 sequences at step 4 (320 tokens)" in log
  resumed = faults.metrics(env, "resumed")
  for key in ("loss", "grad_norm", "mtp_loss", "learning_rate", "batch_size", "expert_load_max"):
    assert column(resumed, key) == column(reference, key), key  # exact, not approx

  # Each checkpoint's data state is the iterator moved on by the microbatches run so far: 1, 1, 1, 2, 2, ...
  from MaxText.data import make_iterator

  cfg = load_config(TINY_RECIPE, ramp_args(env, "x")[1:])
  it = make_iterator(cfg.data, local_batch=4, global_batch=4, seq_len=16, vocab_size=cfg.model.vocab_size)
  microbatches = [1, 1, 1, 2, 2, 2, 2]
  for step in range(1, STEPS + 1):
    for _ in range(microbatches[step - 1]):
      next(it)
    for run in ("reference", "resumed"):
      saved = env["dir"] / "runs" / run / "checkpoints" / str(step) / "data" / "process_0-of-1.json"
      assert json.loads(saved.read_text()) == json.loads(json.dumps(it.get_state())), (run, step)

  # The data state counts microbatches: a resume under another schedule (which would read other rows at
  # each step) is refused.
  done = faults.run(env, ramp_args(env, "resumed", f"steps={STEPS + 1}", "batch_size_schedule=8 for 2 steps; 8"))
  assert done.returncode == 2 and [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
    done.stderr.strip().splitlines()[-1]
  ]
  assert "the data stream differs in batch_size_schedule (checkpoint '4 for 0 tokens;" in done.stderr


def test_a_batch_the_mesh_cannot_run_is_one_error_line_and_nothing_written(env):
  done = faults.run(env, ramp_args(env, "refused", "steps=2", "batch_size_schedule=4 for 1 steps; 6"))
  assert done.returncode == 2 and done.stdout == ""
  assert done.stderr.strip().splitlines() == [
    "error: batch_size_schedule: 6 sequences is not a whole number of microbatches of 4 sequences between 4 and "
    "the step's 8 (the global batch, per_device_batch_size x devices, split into gradient_accumulation_steps=2 "
    "microbatches)"
  ]
  assert not (env["dir"] / "runs" / "refused").exists()
