"""Rotary position embedding, plain or with YaRN context extension.

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models"), as used by DeepSeek-V3: frequencies that rotate more than
`beta_fast` times over the original context are kept, those rotating fewer than
`beta_slow` times are divided by `rope_factor`, with a linear ramp between.
The companion attention-scale correction (mscale) is applied to the softmax
scale in `mla.py`.

Rotation acts on adjacent pairs (x[2i], x[2i+1]) with frequency i, the layout of
DeepSeek's released weights.
"""

import math

import jax
import jax.numpy as jnp

from MaxText.config_schema import ModelConfig


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
  """The frequency index whose wavelength fits `num_rotations` times into `max_pos`."""
  return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(cfg: ModelConfig) -> jax.Array:
  dim, base = cfg.qk_rope_head_dim, cfg.rope_max_timescale
  extrapolated = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if cfg.rope_type == "default" or cfg.rope_factor == 1.0:
    return extrapolated
  interpolated = extrapolated / cfg.rope_factor
  low = max(math.floor(_correction_dim(cfg.beta_fast, dim, base, cfg.original_max_position_embeddings)), 0)
  high = min(math.ceil(_correction_dim(cfg.beta_slow, dim, base, cfg.original_max_position_embeddings)), dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  keep = 1.0 - ramp  # 1 where the frequency is high enough to extrapolate
  return interpolated * (1.0 - keep) + extrapolated * keep


def yarn_mscale(factor: float, mscale: float) -> float:
  return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """cos and sin of shape [batch, seq, rope_dim/2] for integer positions [batch, seq]."""
  angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies(cfg)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates pairs of x [batch, seq, heads, rope_dim] by angle tables [batch, seq, rope_dim/2]."""
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  even, odd = pairs[..., 0], pairs[..., 1]
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  rotated = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)
