"""Host offload of the train state (MaxText/host_offload.py) on CPU devices, which have a pinned_host
memory space: the offloaded parts live there between steps, and training is unchanged."""

import jax
import numpy as np

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
  np.testing.assert_allclose(off_losses, losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(off_state.params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  # The compiled step takes the offloaded state from host memory (and gives it back there).
  assert {s.memory_kind for s in jax.tree.leaves(off_in.params)} == {"pinned_host"}


def test_only_the_optimizer_state(tiny_config):
  trainer = Trainer(
    tiny_config(*SMALL, "optimizer_memory_host_offload=true"), make_mesh(tiny_config(*SMALL).mesh, jax.devices()[:1])
  )
  kinds = lambda tree: {s.memory_kind for s in jax.tree.leaves(tree)}  # noqa: E731
  assert kinds(trainer.state_shardings.params) == {"device"} and kinds(trainer.state_shardings.opt_state) == {
    "pinned_host"
  }
  assert trainer.host_offload_description() == "optimizer state"
