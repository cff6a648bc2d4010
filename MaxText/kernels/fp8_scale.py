"""fp8_blockwise's scale rule, shared by the quantisation kernels (triton_quantize.py) and the jnp format
(quant/formats.py), so that both round the same way bit for bit."""

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
FP8_BLOCK = 128  # DeepSeek-V3's tile: 1x128 for activations, 128x128 for weights
MIN_SCALE = 2.0**-126  # the smallest normal float32: its reciprocal is finite


def blockwise_scale(amax: jax.Array) -> jax.Array:
  """The fp32 scale of blocks with this amax: amax * fp32(1/448) (XLA turns a division by a constant into
  this product anyway), at least the smallest normal float so that its reciprocal is finite (GPUs may
  flush a subnormal scale to zero); 1 for an all-zero block, NaN for one holding Inf or NaN."""
  scale = jnp.where(amax == 0, 1.0, jnp.maximum(amax * jnp.float32(1.0 / E4M3_MAX), MIN_SCALE))
  return jnp.where(jnp.isfinite(amax), scale, jnp.nan)
