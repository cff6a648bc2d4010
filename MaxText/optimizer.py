"""AdamW with linear warmup then cosine decay, and global-norm clipping (optax)."""

import jax
import optax

from MaxText.config_schema import OptimizerConfig
from MaxText.params import is_spec


def learning_rate_schedule(cfg: OptimizerConfig, steps: int) -> optax.Schedule:
  total = steps if cfg.learning_rate_schedule_steps == -1 else cfg.learning_rate_schedule_steps
  warmup = int(cfg.warmup_steps_fraction * total)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=cfg.learning_rate,
      warmup_steps=warmup,
      decay_steps=max(total, warmup + 1),
      end_value=cfg.learning_rate * cfg.cosine_learning_rate_final_fraction,
  )


def make_optimizer(cfg: OptimizerConfig, steps: int, specs) -> optax.GradientTransformation:
  # Decay weight matrices only; norm scales (initialised to ones) are left alone.
  decay_mask = jax.tree.map(lambda s: s.init == "normal", specs, is_leaf=is_spec)
  adamw = optax.adamw(
      learning_rate_schedule(cfg, steps),
      b1=cfg.adam_b1,
      b2=cfg.adam_b2,
      eps=cfg.adam_eps,
      weight_decay=cfg.adam_weight_decay,
      mask=decay_mask,
  )
  if cfg.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
  return adamw
