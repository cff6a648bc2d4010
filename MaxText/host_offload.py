"""Host offload of the train state: parameters and/or optimizer state in pinned host memory between steps.

With `optimizer_memory_host_offload` the AdamW moments (and with `parameter_memory_host_offload`
the fp32 master weights) are arrays whose sharding has memory_kind="pinned_host": they stay in
host memory between steps. Inside the jitted step they move with jax.device_put to the same sharding in
device memory, and the step's out_shardings put the updated state back in pinned host memory.
Parameters move as the step starts (`params_to_device`: the forward pass needs them). The moments move
only once the gradients' global norm exists (`optimizer_state_to_device`), i.e. after the backward pass:
nothing else orders their copies, and XLA started them with the step and held the moments through the
backward pass's peak, which on an H100 made the offload cost memory instead of saving it. The 1-GPU proxy
at 2 sequences on an H100: 63.1 GiB without offload, 64.7 GiB with the copies at the start, 51.0 GiB with
them after the norm (benchmarks/results/2026-12-07-h100-head-offload; 14.8 GiB of moments, ~0.6 s of
copies a step). The copies go over
PCIe (~50 GB/s on H200): fp32 weights plus two fp32 moments are 12 bytes a parameter each way.

Needs devices with a pinned_host memory space (GPU, TPU, and XLA:CPU have one); otherwise a
UserError says so.
"""

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from MaxText.errors import UserError

HOST = "pinned_host"


def _offloaded_fields(train_cfg) -> tuple[str, ...]:
  return (("params",) if train_cfg.parameter_memory_host_offload else ()) + (
    ("opt_state",) if train_cfg.optimizer_memory_host_offload else ()
  )


def describe(train_cfg) -> str:
  fields = _offloaded_fields(train_cfg)
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
  fields = _offloaded_fields(train_cfg)
  if not fields:
    return device_shardings
  check_supported(mesh)
  return device_shardings._replace(**{f: _with_kind(getattr(device_shardings, f), HOST) for f in fields})


def params_to_device(state, device_shardings, train_cfg):
  """Inside the step, at its start: offloaded parameters moved to device memory (a no-op without)."""
  if not train_cfg.parameter_memory_host_offload:
    return state
  return state._replace(params=jax.device_put(state.params, _with_kind(device_shardings.params, "device")))


def optimizer_state_to_device(opt_state, after, device_shardings, train_cfg):
  """Inside the step: offloaded optimizer state moved to device memory once `after` (the gradients' global
  norm) has been computed (a no-op without offload). The barrier is the only thing that orders the copies
  after the backward pass; XLA cannot move an operand's copy before the barrier that produces it."""
  if not train_cfg.optimizer_memory_host_offload:
    return opt_state
  if _planned_moments is not None:
    return _arrived_stand_in(_planned_moments, after, device_shardings.opt_state)
  _, opt_state = jax.lax.optimization_barrier((after, opt_state))
  return jax.device_put(opt_state, _with_kind(device_shardings.opt_state, "device"))


# ---- planning on compile-only GPUs ----
# Compile-only devices have no host memory space: an offloaded argument would be compiled into device memory
# and held through the whole step, which is not what the GPU does. For the planner the step takes no
# optimizer state at all (`None`) and makes stand-ins of its shapes on the device where the GPU's copies land:
# after the gradients' norm, through the same barrier. The peak XLA reports is then that of the GPU program
# (the moments' copies in flight are not modelled).
_planned_moments = None


@contextlib.contextmanager
def planning_without_host_memory(abstract_opt_state):
  """Within: offloaded optimizer state is not an argument of the step but made inside it (see above)."""
  global _planned_moments
  _planned_moments = abstract_opt_state
  try:
    yield
  finally:
    _planned_moments = None


def step_for_planning(step, abstract_opt_state):
  """The train step as the planner compiles it for compile-only GPUs with offloaded optimizer state: it takes
  the state without the optimizer state (None) and makes stand-ins where the GPU's copies land; in place of
  the new optimizer state it returns one element of each, after a barrier that keeps the whole of each on the
  device until the step's end, as the GPU's copies to the host read them. (Returned whole, XLA would give
  them output buffers held through the whole step.)"""

  def planned(state, batch):
    with planning_without_host_memory(abstract_opt_state):
      new, metrics = step(state._replace(opt_state=None), batch)
    written = jax.lax.optimization_barrier(new.opt_state)
    # One element each: flattening a sharded array first would gather it whole.
    return new._replace(opt_state=jax.tree.map(lambda x: x[(0,) * x.ndim], written)), metrics

  return planned


def _arrived_stand_in(abstract, after, shardings):
  # `after * 0` ties each stand-in to the norm (XLA does not fold x * 0 for floats), the barrier makes it a
  # buffer of its own there, as a copy's destination is.
  def make(a, sharding):
    value = jnp.zeros(a.shape, a.dtype) + (after * 0).astype(a.dtype)
    return jax.lax.with_sharding_constraint(value, sharding)

  _, moments = jax.lax.optimization_barrier((after, jax.tree.map(make, abstract, shardings)))
  return moments
