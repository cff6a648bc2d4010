"""The linear layers' GEMMs: XLA's einsum, or the quantised GEMM of the experts for the groups quantised.

DeepSeek-V3 trained every linear layer's GEMM in fp8 (forward, dgrad and wgrad), keeping the embedding, the
output head, the router, the norms and the attention core in higher precision (technical report, section
3.3). `quantize_layers` names the groups that run the quantised GEMM when `quantization` is set:

  attention       MLA's projections: wq_a, wq_b (or wq), wkv_a, wkv_b and the output projection wo
  dense_mlp       the MLP of the dense (first_num_dense_layers) decoder layers
  shared_experts  the MoE layers' shared experts
  experts         the routed experts (the grouped GEMM itself; MaxText/moe/layer.py)

A dense GEMM runs as the grouped GEMM's one-group case: x [rows, K] @ w[None] [1, K, N] with group sizes
[rows], so one kernel set (and its tile tables, fp8 layouts and custom VJP) serves both. Everything else,
and every group not quantised, is the plain einsum as written in the layer, so an unquantised model
compiles to the same program as without this module.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

GROUPS = ("attention", "dense_mlp", "shared_experts", "experts")
# DeepSeek-V3's fp8 set (report, section 3.3): every linear layer of the decoder
PRESETS = {"deepseek_v3": GROUPS, "experts": ("experts",)}


def parse_groups(text: str) -> tuple[str, ...]:
  """quantize_layers' value -> the groups it names; a ValueError (one line) for an unknown name."""
  if text in PRESETS:
    return PRESETS[text]
  names = tuple(dict.fromkeys(g.strip() for g in text.split(",") if g.strip()))
  if not names or (bad := [g for g in names if g not in GROUPS]):
    bad = names and bad
    raise ValueError(
      f"quantize_layers={text!r}: {'unknown group ' + ', '.join(bad) if bad else 'names no group'}; "
      f"choose {' or '.join(PRESETS)}, or a comma list of {', '.join(GROUPS)}"
    )
  return names


class Dense:
  """Runs `jnp.einsum(spec, x, w)` for a linear layer of `group`: the einsum itself, or the quantised GEMM.

  gemm: an ExpertGemm (MaxText/gmm) or None; groups: the groups it runs; mesh: the device mesh (None on one
  device). Under a mesh the quantised GEMM runs per device in a shard_map: rows split like the activations'
  batch axis, the weight whole on every device (the all-gather FSDP does before any GEMM), the weight's
  gradient summed over the row shards by shard_map's transpose.
  """

  def __init__(self, gemm=None, groups: tuple[str, ...] = (), mesh=None, row_axes: tuple[str, ...] = ()):
    self.gemm, self.groups, self.mesh, self.row_axes = gemm, frozenset(groups), mesh, row_axes

  def quantises(self, group: str) -> bool:
    return self.gemm is not None and group in self.groups

  def __call__(self, spec: str, x: jax.Array, w: jax.Array, group: str) -> jax.Array:
    if not self.quantises(group):
      return jnp.einsum(spec, x, w)
    lhs, rhs, out, k = _split(spec)
    batch_shape, k_size = x.shape[: len(lhs) - k], math.prod(x.shape[len(lhs) - k :])
    n_shape = w.shape[k:]
    y = self._gemm(x.reshape(-1, k_size), w.reshape(k_size, -1))
    return y.reshape(*batch_shape, *n_shape)

  def _gemm(self, x2, w2):
    def one_group(x2, w2):
      return self.gemm(x2, w2[None], jnp.array([x2.shape[0]], jnp.int32))

    if self.mesh is None or self.mesh.size == 1:
      return one_group(x2, w2)
    rows = PartitionSpec(self.row_axes or None, None)
    return jax.shard_map(one_group, mesh=self.mesh, in_specs=(rows, PartitionSpec()), out_specs=rows)(x2, w2)


PLAIN = Dense()


def dense_for(cfg, mesh=None) -> Dense:
  """The Dense of a MoEConfig (quantization, moe_gmm_backend, mxfp8_impl, quantize_layers) on `mesh`: the
  registry entry the routed experts run, unfused, for the quantised groups other than "experts"."""
  from MaxText import gmm
  from MaxText.sharding import logical_to_spec

  groups = tuple(g for g in parse_groups(cfg.quantize_layers) if g != "experts")
  if not cfg.quantization or not groups:
    return PLAIN
  name = gmm.entry_name(cfg.quantization, cfg.moe_gmm_backend, gmm.resolve_mxfp8(cfg.mxfp8_impl, jax.devices()[0]))
  batch = logical_to_spec(("batch",))[0]  # the mesh axes the activations' batch is split over
  row_axes = (batch,) if isinstance(batch, str) else tuple(batch or ())
  return Dense(gmm.build(name, gmm.Options(False, False)), groups, mesh, row_axes)


def _split(spec: str) -> tuple[str, str, str, int]:
  """(lhs, rhs, out, number of contracted dims) of a linear layer's einsum: x's trailing dims contract
  with w's leading ones, in order, and the output is x's other dims then w's (e.g. "bshk,hkd->bsd")."""
  inputs, out = spec.replace(" ", "").split("->")
  lhs, rhs = inputs.split(",")
  contracted = "".join(c for c in lhs if c in rhs and c not in out)
  k = len(contracted)
  if not (lhs.endswith(contracted) and rhs.startswith(contracted) and out == lhs[: len(lhs) - k] + rhs[k:]):
    raise ValueError(f"{spec}: not a linear layer's einsum (x [..., K] @ w [K, N...])")
  return lhs, rhs, out, k
