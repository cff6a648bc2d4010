"""The SwiGLU feed-forward block used by the dense layers and the shared experts."""

import jax
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.linear import PLAIN, Dense
from MaxText.params import ParamSpec


def mlp_specs(emb_dim: int, mlp_dim: int) -> dict:
  return {
    "wi_0": ParamSpec((emb_dim, mlp_dim), ("embed", "mlp")),
    "wi_1": ParamSpec((emb_dim, mlp_dim), ("embed", "mlp")),
    "wo": ParamSpec((mlp_dim, emb_dim), ("mlp", "embed")),
  }


def mlp(p: dict, x: jax.Array, shard, dense: Dense = PLAIN, group: str = "dense_mlp") -> jax.Array:
  """x [batch, seq, embed] -> [batch, seq, embed]; dense runs the GEMMs as layer group `group`
  (layers/linear.py: "dense_mlp" or "shared_experts")."""
  # Checkpoint names (MaxText/remat.py): what remat_policy may keep for the backward pass.
  gate = checkpoint_name(dense("bsd,df->bsf", x, p["wi_0"], group), "mlpwi_0")
  up = checkpoint_name(dense("bsd,df->bsf", x, p["wi_1"], group), "mlpwi_1")
  h = checkpoint_name(shard(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp")), "mlpwi")
  return checkpoint_name(dense("bsf,fd->bsd", h, p["wo"], group), "mlpwo")
