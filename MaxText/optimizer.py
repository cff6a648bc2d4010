"""AdamW with linear warmup then cosine decay (or a schedule of phases in steps or tokens,
MaxText/schedules.py), and global-norm clipping (optax).

The moments are kept in the parameters' dtype unless mu_dtype/nu_dtype say otherwise: DeepSeek-V3 keeps
both in bf16 (arXiv 2412.19437, section 3.3.3), which halves the optimizer state's memory and the bytes
the update moves each step; the update itself is computed in float32.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from MaxText import schedules
from MaxText.config_schema import OptimizerConfig
from MaxText.params import is_spec


def learning_rate_schedule(cfg: OptimizerConfig, steps: int, tokens_per_step: int = 1) -> optax.Schedule:
  """The learning rate at a step: warmup_cosine (optax's), or learning_rate_phases, whose amounts in tokens
  are counted at tokens_per_step (global batch x sequence length)."""
  if cfg.learning_rate_schedule == "phases":
    return schedules.Schedule("learning_rate", cfg.learning_rate_phases, tokens_per_step)
  total = steps if cfg.learning_rate_schedule_steps == -1 else cfg.learning_rate_schedule_steps
  warmup = int(cfg.warmup_steps_fraction * total)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=warmup,
    decay_steps=max(total, warmup + 1),
    end_value=cfg.learning_rate * cfg.cosine_learning_rate_final_fraction,
  )


def make_optimizer(cfg: OptimizerConfig, steps: int, specs, tokens_per_step: int = 1) -> optax.GradientTransformation:
  # Decay weight matrices only; norm scales (initialised to ones) are left alone.
  decay_mask = jax.tree.map(lambda s: s.init == "normal", specs, is_leaf=is_spec)
  if cfg.mu_dtype or cfg.nu_dtype:
    adamw = optax.chain(
      scale_by_adam_stored_as(cfg.adam_b1, cfg.adam_b2, cfg.adam_eps, cfg.mu_dtype or None, cfg.nu_dtype or None),
      optax.add_decayed_weights(cfg.adam_weight_decay, decay_mask),
      optax.scale_by_learning_rate(learning_rate_schedule(cfg, steps, tokens_per_step)),
    )
  else:
    adamw = optax.adamw(
      learning_rate_schedule(cfg, steps, tokens_per_step),
      b1=cfg.adam_b1,
      b2=cfg.adam_b2,
      eps=cfg.adam_eps,
      weight_decay=cfg.adam_weight_decay,
      mask=decay_mask,
    )
  if cfg.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
  return adamw


class AdamMoments(NamedTuple):
  count: jax.Array
  mu: Any  # the parameter tree, in mu_dtype
  nu: Any  # the parameter tree, in nu_dtype


def scale_by_adam_stored_as(
  b1: float, b2: float, eps: float, mu_dtype=None, nu_dtype=None
) -> optax.GradientTransformation:
  """optax.scale_by_adam (eps_root 0, no Nesterov) with the moments stored in mu_dtype / nu_dtype (None: the
  parameter's dtype) between steps; read into float32, updated and bias-corrected there, rounded on store."""

  def init(params):
    zeros = lambda dtype: jax.tree.map(lambda p: jnp.zeros(p.shape, dtype or p.dtype), params)  # noqa: E731
    return AdamMoments(jnp.zeros([], jnp.int32), zeros(mu_dtype), zeros(nu_dtype))

  def update(grads, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    mu = jax.tree.map(lambda g, m: b1 * f32(m) + (1 - b1) * f32(g), grads, state.mu)
    nu = jax.tree.map(lambda g, v: b2 * f32(v) + (1 - b2) * jnp.square(f32(g)), grads, state.nu)
    mu_scale = 1 / (1 - jnp.float32(b1) ** count)
    nu_scale = 1 / (1 - jnp.float32(b2) ** count)
    updates = jax.tree.map(
      lambda m, v, g: (m * mu_scale / (jnp.sqrt(v * nu_scale) + eps)).astype(g.dtype), mu, nu, grads
    )
    store = lambda new, old: jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)  # noqa: E731
    return updates, AdamMoments(count, store(mu, state.mu), store(nu, state.nu))

  return optax.GradientTransformation(init, update)
