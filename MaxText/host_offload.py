"""Host offload of the train state: parameters and/or optimizer state in pinned host memory between steps.

With `optimizer_memory_host_offload` the AdamW moments (and with `parameter_memory_host_offload`
the fp32 master weights) are arrays whose sharding has memory_kind="pinned_host": they stay in
host memory between steps, so device memory holds them only while the step runs. Inside the
jitted step `to_device` moves them with jax.device_put to the same sharding in device memory;
the step's out_shardings put the updated state back in pinned host memory. The copies go over
PCIe (~50 GB/s on H200): fp32 weights plus two fp32 moments are 12 bytes a parameter each way.

Needs devices with a pinned_host memory space (GPU, TPU, and XLA:CPU have one); otherwise a
UserError says so.
"""

import jax
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


def to_device(state, device_shardings, train_cfg):
  """Inside the step: the offloaded fields moved to device memory (a no-op without offload)."""
  fields = _offloaded_fields(train_cfg)
  if not fields:
    return state
  return state._replace(
    **{f: jax.device_put(getattr(state, f), _with_kind(getattr(device_shardings, f), "device")) for f in fields}
  )
