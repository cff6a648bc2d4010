"""Host offload of the train state (MaxText/host_offload.py) on CPU devices, which have a pinned_host
memory space: the offloaded parts live there between steps, and training is unchanged."""

import jax
import numpy as np

from MaxText import host_offload
from MaxText.data import SyntheticData
from MaxText.sharding import make_mesh
from MaxText.train_step import Trainer

SMALL = (
  "max_target_length=8",
  "per_device_batch_size=2",
  "base_num_decoder_layers=2",
  "mtp_num_layers=0",
  "remat_policy=none",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0",
  "steps=2",
  "ici_fsdp_parallelism=1",
)


def _run(cfg, steps=2):
  trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
  data = SyntheticData(cfg.data, trainer.global_batch, cfg.train.max_target_length, cfg.model.vocab_size)
  state = trainer.init_state()
  batch = trainer.device_batch(data.batch(0))
  compiled = trainer.jit_step().lower(state, batch).compile()
  losses = []
  for i in range(steps):
    state, metrics = compiled(state, trainer.device_batch(data.batch(i)))
    losses.append(float(metrics["loss"]))
  return state, losses, compiled.input_shardings[0][0]


def _kinds(tree) -> set[str]:
  return {a.sharding.memory_kind for a in jax.tree.leaves(tree)}


def test_offloaded_state_lives_in_pinned_host_memory_and_trains_the_same(tiny_config):
  state, losses, _ = _run(tiny_config(*SMALL))
  off_state, off_losses, off_in = _run(
    tiny_config(*SMALL, "optimizer_memory_host_offload=true", "parameter_memory_host_offload=true")
  )
  assert _kinds(state.params) == _kinds(state.opt_state) == {"device"}
  assert _kinds(off_state.params) == _kinds(off_state.opt_state) == {"pinned_host"}
  assert _kinds(off_state.bias) == {"device"}
  # Exact copies, and the forward and backward passes differentiated through the same cast: the same bits.
  assert off_losses == losses
  off, on = (off_state.params, off_state.opt_state), (state.params, state.opt_state)
  pairs = zip(jax.tree.leaves(off), jax.tree.leaves(on))
  for a, b in pairs:
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The compiled step takes the offloaded state from host memory (and gives it back there).
  assert {s.memory_kind for s in jax.tree.leaves(off_in.params)} == {"pinned_host"}


def test_offloaded_parameters_with_gradient_accumulation_train_the_same(tiny_config):
  """Two microbatches: the gradients of the compute-dtype copy summed in float32 as without offload."""
  accum = ("gradient_accumulation_steps=2", "per_device_batch_size=4")
  state, losses, _ = _run(tiny_config(*SMALL, *accum))
  off_state, off_losses, _ = _run(tiny_config(*SMALL, *accum, "parameter_memory_host_offload=true"))
  assert _kinds(off_state.params) == {"pinned_host"} and _kinds(off_state.opt_state) == {"device"}
  assert off_losses == losses
  for a, b in zip(jax.tree.leaves(off_state.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_offloaded_parameters_train_the_same_on_fsdp_shards(tiny_config):
  """8 devices, fsdp 8: the gradients of the sharded compute-dtype copy are reduce-scattered as without
  offload, and three steps end in the same bits."""

  def run(*extra):
    cfg = tiny_config(*SMALL[:-1], "ici_fsdp_parallelism=8", "steps=3", *extra)
    trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))
    data = SyntheticData(cfg.data, trainer.global_batch, cfg.train.max_target_length, cfg.model.vocab_size)
    state, step, losses = trainer.init_state(), trainer.jit_step(), []
    for i in range(3):
      state, metrics = step(state, trainer.device_batch(data.batch(i)))
      losses.append(float(metrics["loss"]))
    return state, losses

  state, losses = run()
  off_state, off_losses = run("parameter_memory_host_offload=true")
  assert off_losses == losses
  for a, b in zip(jax.tree.leaves(off_state.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_only_the_optimizer_state(tiny_config):
  trainer = Trainer(
    tiny_config(*SMALL, "optimizer_memory_host_offload=true"), make_mesh(tiny_config(*SMALL).mesh, jax.devices()[:1])
  )
  kinds = lambda tree: {s.memory_kind for s in jax.tree.leaves(tree)}  # noqa: E731
  assert kinds(trainer.state_shardings.params) == {"device"} and kinds(trainer.state_shardings.opt_state) == {
    "pinned_host"
  }
  assert trainer.host_offload_description() == "optimizer state"


def test_the_planners_step_makes_the_moments_on_their_shards(tiny_config):
  """host_offload.step_for_planning, the step the planner compiles for compile-only GPUs (no host memory):
  no optimizer-state or parameter argument, the weights and moments made on their shards where their copies
  land, one element of each returned, and nothing of them gathered whole (flattening a sharded moment did
  that: 548 GiB planned for the 671B on 128 x H100)."""
  overrides = (*SMALL[:-1], "ici_fsdp_parallelism=8")
  cfg = tiny_config(*overrides, "optimizer_memory_host_offload=true", "parameter_memory_host_offload=true")
  trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))
  data = SyntheticData(cfg.data, trainer.global_batch, cfg.train.max_target_length, cfg.model.vocab_size)
  batch = trainer.device_batch(data.batch(0))
  state = trainer.abstract_state()
  shardings = trainer.device_state_shardings._replace(opt_state=None, params=None)
  planned = jax.jit(
    host_offload.step_for_planning(trainer.step, {"opt_state": state.opt_state, "params": state.params}),
    in_shardings=(shardings, trainer.batch_sharding),
  )
  lowered = planned.lower(state._replace(opt_state=None, params=None), batch)
  out_state = lowered.out_info[0]
  for field in ("opt_state", "params"):
    assert {a.shape for a in jax.tree.leaves(getattr(out_state, field))} == {()}
    assert jax.tree.structure(getattr(out_state, field)) == jax.tree.structure(getattr(state, field))

  plain = Trainer(tiny_config(*overrides), make_mesh(cfg.mesh, jax.devices()[:8]))
  regular = plain.jit_step().lower(plain.abstract_state(), batch).compile().as_text()
  gathers = lambda hlo: hlo.count(" all-gather(") + hlo.count(" all-gather-start(")  # noqa: E731
  assert gathers(lowered.compile().as_text()) <= gathers(regular)
