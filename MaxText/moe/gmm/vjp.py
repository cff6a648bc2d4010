"""A grouped GEMM with its backward built from three kernels, as a custom VJP.

  y  = x @ w[g]                 forward   fwd(x [M,K], w [G,K,N], sizes) -> [M,N]
  dx = dy @ w[g]^T              dgrad     dgrad(dy [M,N], w [G,K,N], sizes) -> [M,K]
  dw[g] = x_g^T @ dy_g          wgrad     wgrad(x [M,K], dy [M,N], sizes) -> [G,K,N]

Kernel backends (Mosaic GPU today) supply the three functions; the same rule is
tested on CPU with XLA kernels against jax.grad of jax.lax.ragged_dot.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def grouped_gemm_with_vjp(fwd: Callable, dgrad: Callable, wgrad: Callable) -> Callable:
  @jax.custom_vjp
  def gmm(x, w, group_sizes):
    return fwd(x, w, group_sizes)

  def gmm_fwd(x, w, group_sizes):
    return fwd(x, w, group_sizes), (x, w, group_sizes)

  def gmm_bwd(residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = dgrad(dy, w, group_sizes).astype(x.dtype)
    dw = wgrad(x, dy, group_sizes).astype(w.dtype)
    # group_sizes is integer: its cotangent is the float0 zero.
    return dx, dw, jnp.zeros(group_sizes.shape, jax.dtypes.float0)

  gmm.defvjp(gmm_fwd, gmm_bwd)
  return gmm


# XLA formulations of the three kernels: the reference the VJP rule is tested with on CPU.
def xla_fwd(x, w, group_sizes):
  return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)


def xla_dgrad(dy, w, group_sizes):
  return jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), group_sizes, preferred_element_type=dy.dtype)


def xla_wgrad(x, dy, group_sizes):
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
  )
  return jax.lax.ragged_dot_general(x, dy, group_sizes, numbers, preferred_element_type=jnp.float32)
