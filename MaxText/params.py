"""Abstract-first parameters: each weight is declared as a `ParamSpec` (shape,
logical axes, initializer) before any array exists.

From one tree of specs follow the abstract arrays (for AOT compilation and
checkpoint restore targets), the shardings (through the logical-axis rules in
`sharding.py`) and a jitted initialisation that writes each shard in place.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]  # one logical axis name per dim, see sharding.LOGICAL_RULES
  init: str = "normal"  # normal | ones | zeros

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), f"shape {self.shape} and axes {self.axes} differ in rank"
    assert self.init in ("normal", "ones", "zeros"), self.init


def is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def stacked(specs, num: int, axis_name: str = "layers"):
  """The specs of `num` identical layers stacked on a new leading axis (for scan)."""
  return jax.tree.map(lambda s: ParamSpec((num, *s.shape), (axis_name, *s.axes), s.init), specs, is_leaf=is_spec)


def abstract(specs, dtype) -> dict:
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)


def initialize(specs, key: jax.Array, dtype, std: float) -> dict:
  """Random parameters for `specs`; call under jit with out_shardings to create them sharded."""
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  keys = jax.random.split(key, len(leaves))

  def one(spec: ParamSpec, k):
    if spec.init == "ones":
      return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
      return jnp.zeros(spec.shape, dtype)
    return (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

  return jax.tree.unflatten(treedef, [one(s, k) for s, k in zip(leaves, keys)])


def count(specs) -> int:
  total = 0
  for s in jax.tree.leaves(specs, is_leaf=is_spec):
    n = 1
    for d in s.shape:
      n *= d
    total += n
  return total
