"""Schedules in steps or tokens (MaxText/schedules.py): the pretrain recipe's learning rate, MTP weight and
bias update speed equal DeepSeek-V3's (section 4.2) at its boundaries; a bad schedule is one config error;
a run logs each change, applies the scheduled values inside one compiled step, and a resume mid-schedule
continues an uninterrupted run bit for bit."""

import math

import jax
import numpy as np
import pytest

import test_faults as faults
from conftest import REPO, TINY_RECIPE
from MaxText import schedules
from MaxText.config import load_config
from MaxText.errors import UserError

PRETRAIN = REPO / "recipes" / "deepseek_v3_671b" / "pretrain.yml"
T = 10**12  # one trillion tokens
B = 10**9


@pytest.fixture(scope="module")
def pretrain():
  return load_config(PRETRAIN)


def values(sch, steps):
  """The schedule's float32 values at these steps, computed as the training step does (jitted, int32 step)."""
  fn = jax.jit(sch)
  return [float(fn(np.int32(s))) for s in steps]


def f32(x):
  return float(np.float32(x))


def test_paper_learning_rate_at_its_boundaries(pretrain):
  # 10^8 tokens per step puts every boundary of the paper on a step: 2K steps, 10T, 14.3T, 14.633T, 14.8T.
  sch = schedules.Schedule("learning_rate", pretrain.optimizer.learning_rate_phases, 10**8)
  steps = [0, 1000, 2000, 2001, 99_999, 100_000, 121_500, 143_000, 146_329, 146_330, 147_999, 148_000, 10**6]
  at = dict(zip(steps, values(sch, steps)))
  assert at[0] == 0.0  # linear warmup from 0 ...
  assert at[1000] == pytest.approx(1.1e-4, rel=1e-6)
  assert at[2000] == at[2001] == at[99_999] == f32(2.2e-4)  # ... to 2.2e-4 at 2K steps, constant until 10T
  assert at[100_000] == f32(2.2e-4)  # the cosine starts at 10T from the peak
  assert at[121_500] == pytest.approx((2.2e-4 + 2.2e-5) / 2, rel=1e-5)  # halfway through its 4.3T
  assert at[143_000] == at[146_329] == f32(2.2e-5)  # 2.2e-5 at 14.3T, held for 333B
  assert at[146_330] == at[147_999] == f32(7.3e-6)  # 7.3e-6 from 14.633T for the last 167B
  assert at[148_000] == at[10**6] == f32(7.3e-6)  # 14.8T: the end, and held after it
  assert [ph.end_step for ph in sch.phases] == [2000, 100_000, 143_000, 146_330, 148_000]


def test_paper_schedules_at_the_recipe_batch(pretrain):
  """At a constant 15,360 x 4,096 tokens per step (the recipe's batch once its ramp is over; the ramp's own
  token count is tested in test_batch_ramp.py) a boundary in tokens takes effect at the first step that has
  seen that many tokens."""
  tps = 15360 * 4096
  assert pretrain.train.per_device_batch_size * 128 * pretrain.train.max_target_length == tps
  first = lambda tokens: math.ceil(tokens / tps)  # noqa: E731
  lr = schedules.Schedule("learning_rate", pretrain.optimizer.learning_rate_phases, tps)
  at_10t, at_14_3t, at_14_633t, at_end = first(10 * T), first(14.3e12), first(14_633 * B), first(14_800 * B)
  assert at_end <= pretrain.train.steps  # the run covers the whole 14.8T
  got = values(lr, [1999, 2000, at_10t - 1, at_10t, at_14_3t - 1, at_14_3t, at_14_633t - 1, at_14_633t, at_end])
  assert got[0] < f32(2.2e-4) == got[1] == got[2]
  assert got[3] == pytest.approx(2.2e-4, rel=1e-6) and got[3] <= got[2]
  assert got[4] == pytest.approx(2.2e-5, rel=1e-4) and got[4] >= got[5] == f32(2.2e-5) == got[6]
  assert got[7] == got[8] == f32(7.3e-6)

  mtp = schedules.Schedule("mtp_loss_scaling_factor", pretrain.train.mtp_loss_scaling_factor_schedule, tps)
  assert values(mtp, [0, at_10t - 1, at_10t, at_end]) == [f32(0.3), f32(0.3), f32(0.1), f32(0.1)]
  bias = schedules.Schedule("routed_bias_update_rate", pretrain.train.routed_bias_update_rate_schedule, tps)
  assert values(bias, [0, at_14_3t - 1, at_14_3t, at_end]) == [f32(0.001), f32(0.001), 0.0, 0.0]


def test_the_recipe_holds_the_papers_other_hyper_parameters(pretrain):
  o, m, moe, t = pretrain.optimizer, pretrain.model, pretrain.moe, pretrain.train
  assert (o.adam_b1, o.adam_b2, o.adam_weight_decay, o.gradient_clipping_threshold) == (0.9, 0.95, 0.1, 1.0)
  assert m.param_init_std == 0.006 and t.max_target_length == 4096
  assert moe.load_balance_loss_weight == 0.0001
  # At most 4 of the 8 groups of 32 experts (the paper's nodes) per token.
  assert (moe.moe_route_limit_groups, moe.moe_route_limit_topk_groups) == (8, 4) and moe.num_experts == 256
  # Built on the optimized recipe: its kernels and dispatch unchanged.
  optimized = load_config(REPO / "recipes" / "deepseek_v3_671b" / "optimized.yml")
  for key in ("moe_dispatch", "moe_gmm_backend", "quantization", "remat_policy", "mu_dtype", "xla_flag_presets"):
    assert pretrain.to_flat_dict()[key] == optimized.to_flat_dict()[key], key


def test_host_value_and_the_log_lines_follow_the_device_value():
  sch = schedules.Schedule("x", "linear 1 for 4 steps; cosine 0.5 until 1K; 0.1", tokens_per_step=100)
  steps = list(range(14))
  np.testing.assert_allclose([sch.at(s) for s in steps], values(sch, steps), rtol=1e-6)
  lines = schedules.log_lines([sch], 0, 14)
  assert sorted(lines) == [0, 4, 10]
  assert lines[0] == ["schedule: x = 0 at step 0 (0 tokens): linear 0 -> 1 for 4 steps (to step 4)"]
  assert lines[10] == ["schedule: x 0.5335 -> 0.1 at step 10 (1K tokens): 0.1 to the end"]
  assert schedules.log_lines([sch], 5, 14) == {
    5: ["schedule: x = 0.9665 at step 5 (500 tokens): cosine 1 -> 0.5 for 600 tokens (to step 10)"],
    10: ["schedule: x 0.5335 -> 0.1 at step 10 (1K tokens): 0.1 to the end"],
  }


@pytest.mark.parametrize(
  "override, message",
  [
    ("learning_rate_phases=linear 1e-3 for 10", "needs a unit"),
    ("learning_rate_phases=0.1; 0.2", "only the last segment may leave out"),
    ("learning_rate_phases=fast for 2 steps", "cannot read segment"),
    ("learning_rate_phases=0.1 until 2T; 0.2 until 1T", "ends before the segment starts"),
    ("learning_rate_phases=0.1 for 2.5 steps", "not a whole number"),
    ("learning_rate_phases=-1 for 2 steps", "negative"),
    ("mtp_loss_scaling_factor_schedule=0.3 until 10X; 0.1", "cannot read the amount"),
  ],
)
def test_a_bad_schedule_is_one_config_error(tiny_config, override, message):
  with pytest.raises(UserError, match=message):
    tiny_config("learning_rate_schedule=phases", "learning_rate_phases=1e-3 for 2 steps", override)


def test_phases_and_learning_rate_schedule_phases_go_together(tiny_config):
  with pytest.raises(UserError, match="acts only with learning_rate_schedule=phases"):
    tiny_config("learning_rate_phases=0.1 for 2 steps")
  with pytest.raises(UserError, match="learning_rate_schedule=phases needs them"):
    tiny_config("learning_rate_schedule=phases")


# ---- end to end, through `python -m MaxText.train` on one CPU device (test_faults.py's helpers): ----
# 8 sequences x 16 tokens = 128 tokens per step. The runs share a compilation cache: one compiles the step.
RUN = (
  str(TINY_RECIPE),
  "max_target_length=16",
  "per_device_batch_size=8",
  "remat_policy=none",
  "enable_tensorboard=false",
  "compile_heartbeat_seconds=0",
  "base_num_decoder_layers=2",  # one dense layer, one MoE layer, the MTP module: less to compile
  "log_period=1",
  "async_checkpointing=false",
  "learning_rate_schedule=phases",
  # warmup 2 steps; hold until 512 tokens (step 4); cosine to 1e-3 over 384 tokens (steps 4-6); then 5e-4
  "learning_rate_phases=linear 1e-2 for 2 steps; constant 1e-2 until 512 tokens; cosine 1e-3 for 384 tokens; 5e-4",
  "mtp_loss_scaling_factor_schedule=0.3 until 640 tokens; 0.1",  # 0.1 from step 5
  "routed_bias_update_rate_schedule=0.01 until 768 tokens; 0",  # 0 from step 6
)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  d = tmp_path_factory.mktemp("schedules")
  return {
    "dir": d,
    "vars": faults.child_env(d),
  }


def train_run(env, run_name, *overrides):
  done = faults.run(env, [*RUN, f"base_output_directory={env['dir'] / 'runs'}", f"run_name={run_name}", *overrides])
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def test_resume_mid_schedule_matches_an_uninterrupted_run_and_the_log_shows_each_change(env):
  log = train_run(env, "reference", "steps=8", "checkpoint_period=1", "max_num_checkpoints_to_keep=10")
  assert "schedule: learning_rate 0.01 -> 0.01 at step 4 (512 tokens): cosine 0.01 -> 0.001 for 384 tokens" in log
  assert "schedule: mtp_loss_scaling_factor 0.3 -> 0.1 at step 5 (640 tokens): 0.1 to the end" in log
  assert "schedule: routed_bias_update_rate 0.01 -> 0 at step 6 (768 tokens): 0 to the end" in log
  reference = faults.metrics(env, "reference")
  column = lambda m, key: [m[s][key] for s in range(8)]  # noqa: E731
  assert column(reference, "mtp_loss_scaling_factor") == [f32(0.3)] * 5 + [f32(0.1)] * 3
  assert column(reference, "routed_bias_update_rate") == [f32(0.01)] * 6 + [0.0] * 2
  lr = column(reference, "learning_rate")
  assert lr[:5] == [0.0, f32(5e-3), f32(1e-2), f32(1e-2), f32(1e-2)] and lr[4] > lr[5] > lr[6] > f32(1e-3)
  assert lr[7] == f32(5e-4)

  # Stopped at step 5, in the middle of the cosine and just after the MTP weight changed; then resumed.
  train_run(env, "resumed", "steps=5")
  log = train_run(env, "resumed", "steps=8")
  assert "(step 5)" in log and "schedule: mtp_loss_scaling_factor = 0.1 at step 5 (640 tokens)" in log
  assert "schedule: routed_bias_update_rate 0.01 -> 0 at step 6" in log
  resumed = faults.metrics(env, "resumed")
  for key in ("loss", "grad_norm", "mtp_loss", "learning_rate", "mtp_loss_scaling_factor", "expert_load_max"):
    assert column(resumed, key) == column(reference, key), key  # exact, not approx

  # The routing bias moves while its update speed is 0.01 and stands still once it is 0.
  from MaxText.checkpointing import Checkpointer, with_shardings
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  cfg = load_config(TINY_RECIPE, list(RUN[1:]))
  trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
  abstract = with_shardings(trainer.abstract_state(), trainer.state_shardings)
  ckpt = Checkpointer(env["dir"] / "runs" / "reference" / "checkpoints", cfg, abstract, trainer.global_batch)
  bias = {step: np.asarray(ckpt.restore(step)[0].bias["moe_layers"]) for step in (5, 6, 7, 8)}
  ckpt.close()
  assert np.any(bias[5] != bias[6]) and np.array_equal(bias[6], bias[7]) and np.array_equal(bias[7], bias[8])
