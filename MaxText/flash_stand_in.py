"""A compile-only stand-in for cuDNN flash attention, used by the planner (MaxText/aot.py).

cuDNN attention cannot be traced or compiled without the cuDNN library and a GPU (XLA builds
the cuDNN graph while compiling), so the planner swaps `attention=cudnn_flash` for this: the same
inputs and output, and what a flash attention keeps for its backward pass (q, k, v, the output
and a float32 [batch, heads, seq] softmax statistic), computed elementwise: no [seq, seq] buffer,
as in the real kernel. Its numbers are meaningless; its memory footprint is flash attention's
(minus cuDNN's own workspace) and its FLOPs are added from the model formula by the planner.
"""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _attend(q, k, v):
  return _forward(q, k, v)[0]


def _forward(q, k, v):
  stat = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=-1)  # [b, s, h]
  out = (v.astype(jnp.float32) * jax.nn.sigmoid(stat)[..., None]).astype(v.dtype)
  return out, jnp.swapaxes(stat, 1, 2)  # the statistic as flash attention keeps it: [b, h, s] float32


def _fwd(q, k, v):
  out, lse = _forward(q, k, v)
  return out, (q, k, v, out, lse)


def _bwd(res, g):
  q, k, v, out, lse = res
  w = jnp.swapaxes(lse, 1, 2)[..., None] + jnp.sum(
    g.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True
  )
  return (q * w).astype(q.dtype), (k * w).astype(k.dtype), (g * jax.nn.sigmoid(w)).astype(v.dtype)


_attend.defvjp(_fwd, _bwd)


def attention(q, k, v, scale: float, segment_ids=None) -> jax.Array:
  """Signature of MaxText/layers/mla.py's attention functions."""
  del scale, segment_ids
  return _attend(q, k, v)
