"""RMSNorm, computed in float32 whatever the activation dtype."""

import jax
import jax.numpy as jnp

from MaxText.params import ParamSpec


def rms_norm_spec(dim: int) -> ParamSpec:
  return ParamSpec((dim,), ("norm",), init="ones")


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)
