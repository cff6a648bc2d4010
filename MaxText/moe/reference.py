"""A slow, obviously-correct MoE: a Python loop over tokens and their experts.

Every dispatch and grouped-GEMM backend is tested against this. It shares only
the router with the fast path, so it checks the permutation, the GEMMs, the
combine and the shared experts.
"""

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.config_schema import MoEConfig
from MaxText.moe import router


def _swiglu(x, wi_0, wi_1, wo):
  return (jax.nn.silu(x @ wi_0) * (x @ wi_1)) @ wo


def moe_loop(p: dict, x: jax.Array, bias: jax.Array, cfg: MoEConfig, expert_ids: np.ndarray | None = None) -> jax.Array:
  """Differentiable in p and x (jax.grad, not under jit) when the routing `expert_ids` are given:
  they are what router.route picks for these inputs, computed beforehand as concrete values."""
  batch, seq, d = x.shape
  tokens = x.reshape(-1, d)
  r = router.route(tokens, p["gate"], bias, cfg)
  ids, weights = np.asarray(r.expert_ids if expert_ids is None else expert_ids), r.weights
  out = []
  for t in range(tokens.shape[0]):
    acc = jnp.zeros((d,), jnp.float32)
    for j in range(ids.shape[1]):
      e = int(ids[t, j])
      acc += weights[t, j] * _swiglu(tokens[t], p["wi_0"][e], p["wi_1"][e], p["wo"][e]).astype(jnp.float32)
    if cfg.shared_experts:
      s = p["shared"]
      acc += _swiglu(tokens[t], s["wi_0"], s["wi_1"], s["wo"]).astype(jnp.float32)
    out.append(acc.astype(x.dtype))
  return jnp.stack(out).reshape(batch, seq, d)
