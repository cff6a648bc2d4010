"""The expert grouped GEMM's interface: what the MoE layer calls, whatever runs underneath.

  gemm(x [rows, K], w [G, K, N], group_sizes [G]) -> [rows, N]    y[r] = x[r] @ w[g] for row r of group g
  gemm.swiglu_down(gate, up, w, group_sizes)                       gemm(silu(gate) * up, w, group_sizes)
  gemm.quantize_rows(tokens) / gemm.from_quantized_rows(x, xq, w, group_sizes)
                                                                   the gate/up GEMM from rows quantised
                                                                   before the permute (fp8 rows move)

Rows are grouped contiguously; rows past sum(group_sizes) are padding: what a GEMM writes there is
unspecified and callers never read them (the dispatchers' combine gathers only real rows). Everything is
differentiable in x and w. The fused entry points have default implementations, the plain composition, so
a backend overrides only what it fuses; `fuses` says which it does, for the start-up log.
"""

import jax

from MaxText.gmm import vjp


class ExpertGemm:
  """One resolved choice of expert GEMM (an entry of the registry in gmm/__init__.py)."""

  name = ""
  fuses: tuple[str, ...] = ()  # "swiglu_down", "quantized_rows": the entry points it overrides

  def __call__(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    raise NotImplementedError

  def swiglu_down(self, gate: jax.Array, up: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The down GEMM of the expert MLP, from its gate and up projections."""
    return self(jax.nn.silu(gate) * up, w, group_sizes)

  def quantize_rows(self, tokens: jax.Array):
    """The tokens quantised as the gate/up GEMM's rows (row-local formats only); None: not quantised."""
    return None

  def from_quantized_rows(self, x: jax.Array, xq, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """gemm(x, w, group_sizes) where xq (from quantize_rows, permuted like x) already holds x's rows."""
    return self(x, w, group_sizes)


class FunctionGemm(ExpertGemm):
  """A differentiable function as it is (jax.lax.ragged_dot, an einsum, a library's kernel with its VJP).

  `kernels`: its forward, dgrad and wgrad as separate functions, for GEMMs built around them (mxfp8's
  emulation); by default from the function's own VJP, which is linear in each operand."""

  def __init__(self, name: str, function, kernels=None):
    self.name, self.function = name, function
    self.kernels = kernels or kernels_from_vjp(function)

  def __call__(self, x, w, group_sizes):
    return self.function(x, w, group_sizes)


class KernelGemm(FunctionGemm):
  """Three kernels (forward, dgrad, wgrad) under one custom VJP (vjp.grouped_gemm_with_vjp)."""

  def __init__(self, name: str, fwd, dgrad, wgrad):
    super().__init__(name, vjp.grouped_gemm_with_vjp(fwd, dgrad, wgrad), (fwd, dgrad, wgrad))


def kernels_from_vjp(f):
  """(fwd, dgrad, wgrad) of a differentiable grouped GEMM f, through its VJP."""
  import jax.numpy as jnp

  def dgrad(dy, w, sizes):  # f is linear in x: its VJP at any x (zeros) is the dgrad
    return jax.vjp(lambda x: f(x, w, sizes), jnp.zeros((dy.shape[0], w.shape[1]), dy.dtype))[1](dy)[0]

  def wgrad(x, dy, sizes):
    return jax.vjp(lambda w: f(x, w, sizes), jnp.zeros((sizes.shape[0], x.shape[1], dy.shape[1]), x.dtype))[1](dy)[0]

  return f, dgrad, wgrad
