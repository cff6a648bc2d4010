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

from MaxText.sharding import gather_weights, logical_to_spec

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
  batch axis; the weight enters split as stored along its FSDP dim (from `axes`, its logical axes) and is
  all-gathered inside (sharding.gather_weights), so its gradient leaves as a reduce-scatter over FSDP
  (in weight_grad_reduce_dtype), summed over the other row axes by shard_map's transpose. A weight with no
  such dim enters whole and its gradient is summed over every row shard.
  """

  def __init__(
    self, gemm=None, groups: tuple[str, ...] = (), mesh=None, row_axes: tuple[str, ...] = (), reduce_dtype="compute"
  ):
    self.gemm, self.groups, self.mesh, self.row_axes = gemm, frozenset(groups), mesh, row_axes
    self.reduce_dtype = reduce_dtype  # weight_grad_reduce_dtype

  def quantises(self, group: str) -> bool:
    return self.gemm is not None and group in self.groups

  def __call__(self, spec: str, x: jax.Array, w: jax.Array, group: str, axes: tuple[str | None, ...] = ()) -> jax.Array:
    """`axes`: w's logical axes (its ParamSpec's), for the quantised GEMM under a mesh."""
    if not self.quantises(group):
      return jnp.einsum(spec, x, w)
    lhs, rhs, out, k = _split(spec)
    batch_shape, k_size = x.shape[: len(lhs) - k], math.prod(x.shape[len(lhs) - k :])
    n_shape = w.shape[k:]
    y = self._gemm(x.reshape(-1, k_size), w.reshape(k_size, -1), self._fsdp_split(axes, k))
    return y.reshape(*batch_shape, *n_shape)

  def _fsdp_split(self, axes: tuple[str | None, ...], k: int) -> tuple[int, tuple[str, ...]] | None:
    """(dim of w as [K, N], mesh axes) when the weight's one dim split over row axes is K's or N's leading dim
    (a split the reshape to [K, N] keeps); else None."""
    if self.mesh is None or not axes:
      return None
    split = []
    for dim, names in enumerate(logical_to_spec(axes)):
      names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
      names = tuple(a for a in names if a in self.row_axes and self.mesh.shape[a] > 1)
      if names:
        split.append((dim, names))
    if len(split) != 1 or split[0][0] not in (0, k):
      return None
    dim, names = split[0]
    return (0 if dim == 0 else 1), names

  def _gemm(self, x2, w2, fsdp):
    def one_group(x2, w2):
      if fsdp is not None:
        w2 = gather_weights(w2, fsdp[1], fsdp[0], self.reduce_dtype)
      return self.gemm(x2, w2[None], jnp.array([x2.shape[0]], jnp.int32))

    if self.mesh is None or self.mesh.size == 1:
      return one_group(x2, w2)
    rows = PartitionSpec(self.row_axes or None, None)
    w_spec = PartitionSpec() if fsdp is None else PartitionSpec(*[fsdp[1] if d == fsdp[0] else None for d in (0, 1)])
    return jax.shard_map(one_group, mesh=self.mesh, in_specs=(rows, w_spec), out_specs=rows)(x2, w2)


PLAIN = Dense()


def dense_for(cfg, mesh=None) -> Dense:
  """The Dense of a MoEConfig (quantization, moe_gmm_backend, mxfp8_impl, quantize_layers) on `mesh`: the
  registry entry the routed experts run, unfused, for the quantised groups other than "experts"."""
  from MaxText import gmm

  groups = tuple(g for g in parse_groups(cfg.quantize_layers) if g != "experts")
  if not cfg.quantization or not groups:
    return PLAIN
  name = gmm.entry_name(cfg.quantization, cfg.moe_gmm_backend, gmm.resolve_mxfp8(cfg.mxfp8_impl, jax.devices()[0]))
  batch = logical_to_spec(("batch",))[0]  # the mesh axes the activations' batch is split over
  row_axes = (batch,) if isinstance(batch, str) else tuple(batch or ())
  return Dense(gmm.build(name, gmm.Options(False, False)), groups, mesh, row_axes, cfg.weight_grad_reduce_dtype)


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
