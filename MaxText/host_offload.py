"""Host offload of the train state: parameters and/or optimizer state in pinned host memory between steps.

With `optimizer_memory_host_offload` the AdamW moments, and with `parameter_memory_host_offload` the fp32
master weights, are arrays whose sharding has memory_kind="pinned_host": they stay in host memory between
steps, and the step's out_shardings put the updated state back there. Inside the jitted step they move with
jax.device_put to the same sharding in device memory, each copy where it costs the least memory:

- Offloaded parameters are copied in as the step starts and cast to the compute dtype at once
  (`params_for_compute`): the forward and backward passes read only that copy, so the fp32 one is dead
  before the first layer runs. The device holds 2 bytes a parameter through the backward pass, not 4.
- Everything the update reads (moments, and the fp32 master weights a second time) is copied in only once
  the gradients' global norm exists (`state_for_update`), i.e. after the backward pass: nothing else orders
  those copies, and XLA started them with the step and held the moments through the backward pass's peak,
  which on an H100 made the offload cost memory instead of saving it. The 1-GPU proxy at 2 sequences on an
  H100: 63.1 GiB without offload, 64.7 GiB with the moments' copies at the start, 51.0 GiB with them after
  the norm (benchmarks/results/2026-12-07-h100-head-offload; 14.8 GiB of moments, ~0.6 s of copies a step).

The copies go over PCIe (~50 GB/s on H200), not overlapped with compute: the moments in and out, and the
master weights in twice and out once. The values are those of the step without offload (exact copies; the
cast is the one the model makes).

Needs devices with a pinned_host memory space (GPU, TPU, and XLA:CPU have one); otherwise a
UserError says so.
"""

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from MaxText.errors import UserError

HOST = "pinned_host"


def offloaded_fields(train_cfg) -> tuple[str, ...]:
  return (("params",) if train_cfg.parameter_memory_host_offload else ()) + (
    ("opt_state",) if train_cfg.optimizer_memory_host_offload else ()
  )


def describe(train_cfg) -> str:
  fields = offloaded_fields(train_cfg)
  names = {"params": "parameters", "opt_state": "optimizer state"}
  return ", ".join(names[f] for f in fields) or "none"


def check_supported(mesh) -> None:
  device = mesh.devices.flat[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001 - a device type without memory spaces in its API
    return
  if kinds and HOST not in kinds:  # compile-only devices list none: the compiler checks them
    raise UserError(
      f"optimizer_memory_host_offload/parameter_memory_host_offload need a {HOST} memory space, "
      f"which {device.platform} devices ({device.device_kind}) do not have (they have: {', '.join(sorted(kinds))})"
    )


def _with_kind(tree, kind: str):
  return jax.tree.map(lambda s: NamedSharding(s.mesh, s.spec, memory_kind=kind), tree)


def state_shardings(device_shardings, train_cfg, mesh):
  """The TrainState shardings with the offloaded fields in pinned host memory."""
  fields = offloaded_fields(train_cfg)
  if not fields:
    return device_shardings
  check_supported(mesh)
  return device_shardings._replace(**{f: _with_kind(getattr(device_shardings, f), HOST) for f in fields})


def params_for_compute(params, step, device_shardings, train_cfg):
  """Inside the step, at its start: the parameters the forward and backward passes read. Offloaded ones are
  copied to the device (on compile-only GPUs, made there: see below); the caller casts them to the compute
  dtype at once. `step` (the state's counter) ties the planner's stand-ins to the step's start."""
  if not train_cfg.parameter_memory_host_offload:
    return params
  if _planned is not None:
    return _arrived_stand_in(_planned["params"], step.astype(jnp.float32), device_shardings.params)
  return jax.device_put(params, _with_kind(device_shardings.params, "device"))


def state_for_update(state, after, device_shardings, train_cfg):
  """Inside the step: the state with its offloaded parameters and optimizer state copied to device memory
  once `after` (the gradients' global norm) has been computed (unchanged without offload). The barrier is the
  only thing that orders the copies after the backward pass; XLA cannot move an operand's copy before the
  barrier that produces it."""
  fields = offloaded_fields(train_cfg)
  if not fields:
    return state
  if _planned is not None:
    return state._replace(**{f: _arrived_stand_in(_planned[f], after, getattr(device_shardings, f)) for f in fields})
  _, moved = jax.lax.optimization_barrier((after, {f: getattr(state, f) for f in fields}))
  return state._replace(
    **{f: jax.device_put(moved[f], _with_kind(getattr(device_shardings, f), "device")) for f in fields}
  )


# ---- planning on compile-only GPUs ----
# Compile-only devices have no host memory space: an offloaded argument would be compiled into device memory
# and held through the whole step, which is not what the GPU does. For the planner the step takes no
# offloaded state at all (`None`) and makes stand-ins of its shapes on the device where the GPU's copies land:
# the parameters as the step starts, everything the update reads after the gradients' norm, through the same
# barrier. The peak XLA reports is then that of the GPU program (the copies in flight are not modelled).
_planned = None


@contextlib.contextmanager
def planning_without_host_memory(abstract_fields: dict):
  """Within: the offloaded fields of the train state (name -> abstract value) are not arguments of the step
  but made inside it (see above)."""
  global _planned
  _planned = abstract_fields
  try:
    yield
  finally:
    _planned = None


def step_for_planning(step, abstract_fields: dict):
  """The train step as the planner compiles it for compile-only GPUs with offloaded state: it takes the state
  with the offloaded fields None and makes stand-ins where the GPU's copies land; in place of each new
  offloaded field it returns one element of each array, after a barrier that keeps the whole of each on the
  device until the step's end, as the GPU's copies to the host read them. (Returned whole, XLA would give
  them output buffers held through the whole step.)"""

  def planned(state, batch):
    with planning_without_host_memory(abstract_fields):
      new, metrics = step(state._replace(**dict.fromkeys(abstract_fields)), batch)
    written = jax.lax.optimization_barrier({f: getattr(new, f) for f in abstract_fields})
    # One element each: flattening a sharded array first would gather it whole.
    return new._replace(**{f: jax.tree.map(lambda x: x[(0,) * x.ndim], written[f]) for f in written}), metrics

  return planned


def _arrived_stand_in(abstract, after, shardings):
  # `after * 0` ties each stand-in to its copy's moment (XLA does not fold x * 0 for floats), the barrier
  # makes it a buffer of its own there, as a copy's destination is.
  def make(a, sharding):
    value = jnp.zeros(a.shape, a.dtype) + (after * 0).astype(a.dtype)
    return jax.lax.with_sharding_constraint(value, sharding)

  _, arrived = jax.lax.optimization_barrier((after, jax.tree.map(make, abstract, shardings)))
  return arrived
