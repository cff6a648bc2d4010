"""Checkpoints: sharded round trip (params, optimizer, routing bias, step, data state), keep-K, half-written
saves ignored (also after a SIGKILL mid-write), incompatible configs named key by key, load_parameters_path."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO
from MaxText.checkpointing import Checkpointer, load_parameters, with_shardings
from MaxText.errors import UserError
from MaxText.sharding import make_mesh
from MaxText.train_step import Trainer

SMALL = ("max_target_length=16", "per_device_batch_size=1")


def setup(tiny_config, *overrides, devices=None):
  cfg = tiny_config(*SMALL, *overrides)
  trainer = Trainer(cfg, make_mesh(cfg.mesh, devices))
  return cfg, trainer, with_shardings(trainer.abstract_state(), trainer.state_shardings)


def fake_state(abstract, seed=0):
  """A state of random values placed like `abstract` (no jit: Trainer.init_state takes seconds to compile)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda a: jax.device_put((rng.standard_normal(a.shape) * 3).astype(a.dtype), a.sharding), abstract
  )


def test_round_trip_is_exact_and_keeps_types_and_shardings(tiny_config, tmp_path):
  cfg, trainer, abstract = setup(tiny_config, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  state = fake_state(abstract)
  saver = Checkpointer(tmp_path / "ck", cfg, abstract, trainer.global_batch)
  saver.save(7, state, {"parent": {"next_index": 12}, "counter": 3})
  saver.close()

  loader = Checkpointer(tmp_path / "ck", cfg, abstract, trainer.global_batch)
  assert loader.latest_step() == 7
  loader.check_compatible(7)
  restored, data_state = loader.restore(7)
  assert data_state == {"parent": {"next_index": 12}, "counter": 3}
  assert jax.tree.structure(restored) == jax.tree.structure(state)  # optax NamedTuples, not dicts
  for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    assert got.sharding == want.sharding and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(np.abs(restored.bias["moe_layers"]).sum()) > 0  # the routing bias is in the checkpoint


def test_keeps_the_newest_k_and_ignores_a_half_written_step(tiny_config, tmp_path):
  cfg, trainer, abstract = setup(tiny_config, "max_num_checkpoints_to_keep=2", devices=jax.devices()[:1])
  state = fake_state(abstract)
  ck = Checkpointer(tmp_path / "ck", cfg, abstract, trainer.global_batch)
  for step in (1, 2, 3, 4):
    ck.save(step, state, {"step": step})
  ck.close()
  junk = tmp_path / "ck" / "9.orbax-checkpoint-tmp-1234567"
  (junk / "state").mkdir(parents=True)
  (junk / "state" / "partial").write_text("half written")
  ck = Checkpointer(tmp_path / "ck", cfg, abstract, trainer.global_batch)
  # Removed by the time the constructor returns: a process that exits right after (a refused resume)
  # must not leave orbax's cleanup thread running into interpreter shutdown.
  assert not junk.exists()
  assert sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == [3, 4]
  assert ck.latest_step() == 4
  assert ck.restore(4)[1] == {"step": 4}


KILL_MID_SAVE = """
import os, signal, sys
import jax, numpy as np
sys.path.insert(0, {repo!r})
from MaxText.config import load_config
from MaxText.checkpointing import Checkpointer, with_shardings
from MaxText.sharding import make_mesh
from MaxText.train_step import Trainer
cfg = load_config({recipe!r}, ["vocab_size=131072", "max_num_checkpoints_to_keep=1"])
trainer = Trainer(cfg, make_mesh(cfg.mesh))
abstract = with_shardings(trainer.abstract_state(), trainer.state_shardings)
ck = Checkpointer({ck!r}, cfg, abstract, trainer.global_batch)
state = jax.tree.map(lambda a: jax.device_put(np.ones(a.shape, a.dtype), a.sharding), abstract)
ck.save(1, state, {{"step": 1}})
ck.wait()
ck.save(2, state, {{"step": 2}})  # async: returns once the arrays are on the host, then dies mid-write
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkill_during_an_async_save_keeps_the_latest_good_checkpoint(tiny_config, tmp_path):
  ck_dir = tmp_path / "ck"
  script = KILL_MID_SAVE.format(repo=str(REPO), recipe=str(REPO / "recipes/deepseek_v3_tiny.yml"), ck=str(ck_dir))
  proc = subprocess.run(
    [sys.executable, "-c", script],
    env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == -9, proc.stderr
  assert any(".orbax-checkpoint-tmp" in p.name for p in ck_dir.iterdir())  # it did die mid-save
  cfg, trainer, abstract = setup(
    tiny_config, "vocab_size=131072", "max_num_checkpoints_to_keep=1", devices=jax.devices()[:1]
  )
  ck = Checkpointer(ck_dir, cfg, abstract, trainer.global_batch)
  assert ck.latest_step() == 1  # step 1 was not deleted for the unfinished step 2
  state, data_state = ck.restore(1)
  assert data_state == {"step": 1} and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_incompatible_config_names_the_keys_that_differ(tiny_config, tmp_path):
  cfg, trainer, abstract = setup(tiny_config, devices=jax.devices()[:1])
  ck = Checkpointer(tmp_path / "ck", cfg, abstract, trainer.global_batch)
  ck.save(3, fake_state(abstract), {"step": 3})
  ck.close()

  def check(*overrides):
    other, other_trainer, other_abstract = setup(tiny_config, *overrides, devices=jax.devices()[:1])
    Checkpointer(tmp_path / "ck", other, other_abstract, other_trainer.global_batch).check_compatible(3)

  check("learning_rate=1e-4", "steps=50", "log_period=7")  # schedule and logging may change on resume
  with pytest.raises(UserError) as e:
    check("base_emb_dim=32")
  assert "is from an incompatible config: its train state does not match (params/" in str(e.value)
  assert "keys that differ: base_emb_dim (checkpoint 64, now 32)" in str(e.value) and "\n" not in str(e.value)
  differ = (
    r"the data stream differs in data_shuffle_seed \(checkpoint 0, now 5\), "
    r"per_device_batch_size \(checkpoint 1, now 2\)"
  )
  with pytest.raises(UserError, match=differ):
    check("data_shuffle_seed=5", "per_device_batch_size=2")
  with pytest.raises(UserError, match=r"keys that differ: num_experts \(checkpoint 8, now 16\)"):
    check("num_experts=16")


def test_load_parameters_path_takes_only_the_parameters(tiny_config, tmp_path):
  cfg, trainer, abstract = setup(tiny_config, devices=jax.devices()[:1])
  state = fake_state(abstract)
  ck = Checkpointer(tmp_path / "ck", cfg, abstract, trainer.global_batch)
  ck.save(7, state, {"step": 7})
  ck.close()
  loaded = load_parameters(str(tmp_path / "ck" / "7"), abstract.params)
  for want, got in zip(jax.tree.leaves(state.params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  _, _, other = setup(tiny_config, "base_mlp_dim=64", devices=jax.devices()[:1])
  mismatch = (
    r"parameters do not match this model "
    r"\(params/dense_layers/ffn/wi_0: checkpoint \[1, 64, 128\] float32, now \[1, 64, 64\] float32\)"
  )
  with pytest.raises(UserError, match=mismatch):
    load_parameters(str(tmp_path / "ck" / "7"), other.params)
  with pytest.raises(UserError, match="is not a checkpoint step directory"):
    load_parameters(str(tmp_path), other.params)
