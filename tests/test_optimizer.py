"""AdamW moments stored in a lower precision (mu_dtype / nu_dtype): same math as optax, smaller state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from MaxText.optimizer import scale_by_adam_stored_as
from MaxText.train import train


def _tree(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, (16, 8), jnp.float32), "b": {"s": jax.random.normal(k2, (8,), jnp.float32)}}


def test_float32_moments_match_optax_adam_step_for_step():
  params = _tree(0)
  ours, theirs = scale_by_adam_stored_as(0.9, 0.95, 1e-8), optax.scale_by_adam(0.9, 0.95, 1e-8)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  for step in range(4):
    grads = _tree(step + 1)
    u_ours, s_ours = ours.update(grads, s_ours)
    u_theirs, s_theirs = theirs.update(grads, s_theirs)
    for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs)):
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  assert int(s_ours.count) == 4


def test_bfloat16_moments_are_stored_rounded_and_the_update_stays_close():
  params = _tree(0)
  low, full = (
    scale_by_adam_stored_as(0.9, 0.95, 1e-8, jnp.bfloat16, jnp.bfloat16),
    scale_by_adam_stored_as(0.9, 0.95, 1e-8),
  )
  s_low, s_full = low.init(params), full.init(params)
  for step in range(3):
    grads = _tree(step + 1)
    u_low, s_low = low.update(grads, s_low)
    u_full, s_full = full.update(grads, s_full)
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves((s_low.mu, s_low.nu)))
  assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(u_low))
  for m_low, m_full in zip(jax.tree.leaves(s_low.mu), jax.tree.leaves(s_full.mu)):
    np.testing.assert_allclose(np.asarray(m_low, np.float32), m_full, rtol=1e-2, atol=1e-3)
  for a, b in zip(jax.tree.leaves(u_low), jax.tree.leaves(u_full)):
    np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2)


def test_training_with_bfloat16_moments_follows_float32(tiny_config, tmp_path):
  common = (
    "max_target_length=16",
    "per_device_batch_size=2",
    "steps=40",
    "learning_rate=1e-2",
    "warmup_steps_fraction=0.1",
    "remat_policy=none",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    f"base_output_directory={tmp_path}",
  )
  full = [h["loss"] for h in train(tiny_config(*common, "run_name=f32"))]
  low = [h["loss"] for h in train(tiny_config(*common, "run_name=bf16", "mu_dtype=bfloat16", "nu_dtype=bfloat16"))]
  assert np.mean(low[-5:]) < 0.8 * low[0]  # it learns
  assert abs(np.mean(low[-5:]) - np.mean(full[-5:])) < 0.02 * np.mean(full[-5:])
