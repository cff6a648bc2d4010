"""The SwiGLU feed-forward block used by the dense layers and the shared experts."""

import jax
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.linear import PLAIN, Dense
from MaxText.params import ParamSpec


# Each weight's logical axes (MaxText/sharding.py): its ParamSpec's, and what its GEMM is told (linear.Dense).
AXES = {"wi_0": ("embed", "mlp"), "wi_1": ("embed", "mlp"), "wo": ("mlp", "embed")}


def mlp_specs(emb_dim: int, mlp_dim: int) -> dict:
  return {
    "wi_0": ParamSpec((emb_dim, mlp_dim), AXES["wi_0"]),
    "wi_1": ParamSpec((emb_dim, mlp_dim), AXES["wi_1"]),
    "wo": ParamSpec((mlp_dim, emb_dim), AXES["wo"]),
  }


def mlp(p: dict, x: jax.Array, shard, dense: Dense = PLAIN, group: str = "dense_mlp") -> jax.Array:
  """x [batch, seq, embed] -> [batch, seq, embed]; dense runs the GEMMs as layer group `group`
  (layers/linear.py: "dense_mlp" or "shared_experts")."""

  def proj(spec: str, x: jax.Array, name: str) -> jax.Array:
    return dense(spec, x, p[name], group, AXES[name])

  # Checkpoint names (MaxText/remat.py): what remat_policy may keep for the backward pass.
  gate = checkpoint_name(proj("bsd,df->bsf", x, "wi_0"), "mlpwi_0")
  up = checkpoint_name(proj("bsd,df->bsf", x, "wi_1"), "mlpwi_1")
  h = checkpoint_name(shard(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp")), "mlpwi")
  return checkpoint_name(proj("bsf,fd->bsd", h, "wo"), "mlpwo")
