"""A grouped GEMM with its backward built from three kernels, as a custom VJP.

  y  = x @ w[g]                 forward   fwd(x [M,K], w [G,K,N], sizes) -> [M,N]
  dx = dy @ w[g]^T              dgrad     dgrad(dy [M,N], w [G,K,N], sizes) -> [M,K]
  dw[g] = x_g^T @ dy_g          wgrad     wgrad(x [M,K], dy [M,N], sizes) -> [G,K,N]

Kernel backends (Mosaic GPU today) supply the three functions; the same rule is
tested on CPU with XLA kernels against jax.grad of jax.lax.ragged_dot. Inside
shard_map (expert parallelism) the results get their varying-axes types here,
and weight gradients are summed over the axes the weights are replicated on.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _vma(a) -> frozenset:
  """The shard_map mesh axes `a` varies over (empty outside shard_map)."""
  manual = getattr(jax.typeof(a), "manual_axis_type", None)  # jax 0.11: ManualAxisType(varying=...)
  return frozenset(manual.varying) if manual is not None else frozenset()


def typed(result, *inputs, like=None):
  """Gives a kernel's result the shard_map type its math has, then that of `like`.

  A Pallas kernel's output carries no varying-axes type, though it varies wherever its inputs do; and
  a gradient computed from per-device rows (wgrad from x, dy) is a partial sum where the parameter it
  belongs to is the same on every device of an axis: those partials are summed over that axis.
  """
  varying = frozenset().union(*(_vma(a) for a in inputs))
  missing = tuple(sorted(varying - _vma(result)))
  if missing:
    result = jax.lax.pcast(result, missing, to="varying")
  if like is not None:
    extra = tuple(sorted(_vma(result) - _vma(like)))
    if extra:
      result = jax.lax.psum(result, extra)
    missing = tuple(sorted(_vma(like) - _vma(result)))
    if missing:
      result = jax.lax.pcast(result, missing, to="varying")
  return result


def grouped_gemm_with_vjp(fwd: Callable, dgrad: Callable, wgrad: Callable) -> Callable:
  @jax.custom_vjp
  def gmm(x, w, group_sizes):
    return typed(fwd(x, w, group_sizes), x, w, group_sizes)

  def gmm_fwd(x, w, group_sizes):
    return typed(fwd(x, w, group_sizes), x, w, group_sizes), (x, w, group_sizes)

  def gmm_bwd(residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = typed(dgrad(dy, w, group_sizes).astype(x.dtype), dy, w, group_sizes, like=x)
    dw = typed(wgrad(x, dy, group_sizes).astype(w.dtype), x, dy, group_sizes, like=w)
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
