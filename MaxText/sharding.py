"""The device mesh and the one table from logical axis names to mesh axes.

Parameters (through their ParamSpec axes) and activations (through `Sharder`)
are placed by the same rules, so changing a parallelism strategy means editing
`LOGICAL_RULES`, not the model.
"""

import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config_schema import MeshConfig
from MaxText.errors import UserError
from MaxText.params import is_spec

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical name -> mesh axis (or tuple of axes, or None = replicated)
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
  # activations
  "batch": ("data", "fsdp", "expert"),
  "seq": None,
  "act_embed": None,
  "act_heads": "tensor",
  "act_mlp": "tensor",
  # parameters
  "layers": None,
  "vocab": "tensor",
  "embed": "fsdp",
  "heads": "tensor",
  "head_dim": None,
  "q_lora": None,
  "kv_lora": None,
  # The latent side of the MLA up-projections (wq_b, wkv_b: 11.8 GiB of fp32 weights per GPU in
  # the 671B if replicated): FSDP-sharded, as upstream MaxText does.
  "q_lora_in": "fsdp",
  "kv_lora_in": "fsdp",
  "mlp": "tensor",
  "exp": "expert",
  "exp_router": None,
  "norm": None,
}


def logical_to_spec(axes: tuple[str | None, ...]) -> PartitionSpec:
  used: set[str] = set()
  out = []
  for name in axes:
    mesh_axes = LOGICAL_RULES[name] if name is not None else None
    as_tuple = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    clash = used.intersection(as_tuple)
    assert not clash, f"logical axes {axes} map mesh axis {clash} twice"
    used.update(as_tuple)
    out.append(None if not as_tuple else as_tuple[0] if len(as_tuple) == 1 else as_tuple)
  return PartitionSpec(*out)


def mesh_shape(cfg: MeshConfig, num_devices: int, num_slices: int = 1) -> dict[str, int]:
  """Resolve -1 entries and check that the mesh covers exactly the devices."""
  shape = {}
  for level, count in (("ici", num_devices // num_slices), ("dcn", num_slices)):
    sizes = {a: getattr(cfg, f"{level}_{a}_parallelism") for a in MESH_AXES}
    for a, v in sizes.items():
      if v == 0 or v < -1:
        raise UserError(f"{level}_{a}_parallelism={v}: must be a positive size or -1 (fill)")
    fill = [a for a, v in sizes.items() if v == -1]
    if len(fill) > 1:
      raise UserError(f"only one {level}_*_parallelism may be -1; got -1 for {', '.join(fill)}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
      if count % fixed:
        raise UserError(
          f"{level} mesh: {count} devices are not divisible by the fixed axes' product {fixed} ({_fmt(sizes)})"
        )
      sizes[fill[0]] = count // fixed
    if math.prod(sizes.values()) != count:
      raise UserError(
        f"{level} mesh {_fmt(sizes)} has {math.prod(sizes.values())} devices but {count} are available; "
        f"make the product {count} or set one axis to -1"
      )
    for a in MESH_AXES:
      shape[a] = shape.get(a, 1) * sizes[a]
  return shape


def _fmt(sizes: dict[str, int]) -> str:
  return " x ".join(f"{a}={v}" for a, v in sizes.items())


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  num_slices = len({getattr(d, "slice_index", 0) for d in devices})
  shape = mesh_shape(cfg, len(devices), num_slices)
  return Mesh(np.asarray(devices).reshape([shape[a] for a in MESH_AXES]), MESH_AXES)


def param_shardings(specs, mesh: Mesh):
  return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s.axes)), specs, is_leaf=is_spec)


class Sharder:
  """Constrains activations by logical axes; a no-op without a mesh (unit tests, reference paths)."""

  def __init__(self, mesh: Mesh | None = None):
    self.mesh = mesh

  def __call__(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, logical_to_spec(axes)))

  def named(self, axes: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(self.mesh, logical_to_spec(axes))

  def devices_along(self, axis: str) -> int:
    """How many devices a logical axis is split over (1 without a mesh)."""
    if self.mesh is None:
      return 1
    spec = logical_to_spec((axis,))[0]
    names = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return int(np.prod([self.mesh.shape[a] for a in names], dtype=np.int64))


def per_device_bytes(tree, shardings) -> int:
  """Bytes one device holds of `tree` (abstract arrays) placed by `shardings`."""
  total = 0
  for leaf, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    total += int(np.prod(s.shard_shape(leaf.shape), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def host_bytes(tree, shardings) -> int:
  """Bytes of `tree` per device placed in host memory (memory_kind pinned_host / unpinned_host)."""
  host = [
    (a, s)
    for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
    if "host" in (getattr(s, "memory_kind", None) or "")
  ]
  return per_device_bytes([a for a, _ in host], [s for _, s in host]) if host else 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_weights(w: jax.Array, axes: tuple[str, ...], dim: int, reduce_dtype: str) -> jax.Array:
  """Inside shard_map: a weight split over mesh `axes` along `dim`, all-gathered (tiled) in its own dtype, as
  FSDP does before a GEMM. Its gradient is reduce-scattered back in `reduce_dtype` (weight_grad_reduce_dtype),
  then cast to w's dtype: "compute" (the default) reduces in w's own dtype, the compute dtype, as the
  all-reduce it replaces did (bf16 models round at every hop); "float32" keeps the sum over the ranks'
  tokens at float32 precision, for twice the bytes in a bf16 model.
  Gathered at a shard_map's boundary instead, the weight would enter replicated over `axes`, and its gradient
  would leave as an all-reduce of the whole weight followed by a slice: twice the bytes."""
  return jax.lax.all_gather(w, axes, axis=dim, tiled=True)


def _gather_fwd(w, axes, dim, reduce_dtype):
  return gather_weights(w, axes, dim, reduce_dtype), None


def _gather_bwd(axes, dim, reduce_dtype, _, g):  # g has the gathered weights' dtype, which is w's
  dtype = g.dtype if reduce_dtype == "compute" else reduce_dtype
  summed = jax.lax.psum_scatter(g.astype(dtype), axes, scatter_dimension=dim, tiled=True)
  return (summed.astype(g.dtype),)


gather_weights.defvjp(_gather_fwd, _gather_bwd)
