"""Executed matrix FLOPs of a jitted function, counted on its jaxpr.

XLA's cost analysis is not available for compile-only GPU executables, and on a
lowered module it counts a while loop's body once, so a scanned 61-layer model
would count as one layer. This walks the jaxpr instead: every dot_general and
ragged_dot_general (2 x multiply-adds), with scan bodies multiplied by their
length and every nested jaxpr (jit, remat, custom_vjp/jvp, shard_map, cond)
entered. Rematerialised forward passes appear in the backward pass and are
counted again: this is the work the GPU executes (hardware FLOPs), not the
model FLOPs of MaxText/flops.py. A ragged GEMM counts every row of its operand,
padding included (group sizes are data): with padded or worst-case buffers
(expert-parallel receive buffers) this over-counts, so it is an upper estimate.
Elementwise work is ignored (it is bandwidth, not tensor-core, bound). Pallas
kernels count what their `cost_estimate` says; those without one are reported
as uncounted.
"""

import math
from dataclasses import dataclass

import jax
from jax.extend import core as jcore


# Pallas kernel calls (jax 0.11 traces pallas_call as mpmd_map).
KERNEL_CALLS = ("pallas_call", "mpmd_map")


@dataclass
class Count:
  flops: float = 0.0
  uncounted_kernels: int = 0  # Pallas kernel calls without a cost estimate, per execution


def _dot_flops(eqn) -> float:
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  (contract, _), _ = eqn.params["dimension_numbers"]
  out = eqn.outvars[0].aval
  return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract)


def _ragged_dot_flops(eqn) -> float:
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  nums = eqn.params["ragged_dot_dimension_numbers"]
  out = eqn.outvars[0].aval
  if nums.rhs_group_dimensions:  # each lhs row meets one group's matrix: out rows x contraction
    (contract, _), _ = nums.dot_dimension_numbers
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract)
  # ragged contraction (weight gradient): each row m adds a K x N outer product to its group
  m = lhs.shape[nums.lhs_ragged_dimensions[0]]
  return 2.0 * math.prod(lhs.shape) * math.prod(rhs.shape) / m


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for x in vs:
      if isinstance(x, jcore.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jcore.Jaxpr):
        yield x


def count_jaxpr(jaxpr, times: float, acc: Count) -> None:
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      acc.flops += times * _dot_flops(eqn)
    elif name == "ragged_dot_general":
      acc.flops += times * _ragged_dot_flops(eqn)
    elif name in KERNEL_CALLS:  # a kernel's body is per-block code: count its estimate, never its insides
      est = eqn.params.get("cost_estimate")
      if est is not None and getattr(est, "flops", None):
        acc.flops += times * est.flops
      else:
        acc.uncounted_kernels += int(times)
    elif name == "scan":
      count_jaxpr(eqn.params["jaxpr"].jaxpr, times * eqn.params["length"], acc)
    elif name == "cond":  # the most expensive branch
      branches = []
      for br in eqn.params["branches"]:
        c = Count()
        count_jaxpr(br.jaxpr, times, c)
        branches.append(c)
      worst = max(branches, key=lambda c: c.flops)
      acc.flops += worst.flops
      acc.uncounted_kernels += worst.uncounted_kernels
    elif name == "shard_map":
      # The body sees one shard; it runs once per device of the manual axes.
      mesh = eqn.params["mesh"]
      axes = eqn.params.get("manual_axes") or getattr(mesh, "axis_names", ())
      shards = math.prod(mesh.shape[a] for a in axes)
      count_jaxpr(eqn.params["jaxpr"], times * shards, acc)
    else:
      for sub in _sub_jaxprs(eqn):
        count_jaxpr(sub, times, acc)


def step_flops(fn, *args) -> Count:
  """Global (all devices together) executed matrix FLOPs of one call of fn(*args); args may be abstract."""
  closed = jax.make_jaxpr(fn)(*args)
  acc = Count()
  count_jaxpr(closed.jaxpr, 1.0, acc)
  return acc
