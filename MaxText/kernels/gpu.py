"""What the kernels need to know about the GPU they run on (or are compiled for).

One place for the SM count and the compute capability, read by the kernels' grids, by the expert-GEMM
registry when it decides what can run where, and by the doctor.
"""

import jax

HOPPER_SMS = 132  # H100 SXM and H200: what compile-only devices (no core_count) are assumed to have
INTERPRET_SMS = 3  # in Pallas' GPU interpreter: enough to share tiles between programs, few enough to run quickly
HOPPER = "9.0"  # sm_90: the wgmma instructions of the Mosaic GPU kernels exist here only
BLOCK_SCALED_MMA_MAJOR = 10  # sm_100 (Blackwell) and later: tcgen05 MMA with block scales (MXFP8)


def num_sms() -> int:
  """SMs of the first GPU; a Hopper's count when there is no GPU backend (compile-only devices)."""
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:
    return HOPPER_SMS


def compute_capability(device) -> str | None:
  """ "9.0" for an H100/H200; None for a CPU or a device that does not say."""
  if getattr(device, "platform", None) not in ("gpu", "cuda"):
    return None
  capability = getattr(device, "compute_capability", None)
  return None if capability is None else str(capability)


def is_hopper(device) -> bool:
  return compute_capability(device) == HOPPER


def has_block_scaled_mma(device) -> bool:
  capability = compute_capability(device)
  return capability is not None and int(capability.split(".")[0]) >= BLOCK_SCALED_MMA_MAJOR


def sm_name(device) -> str:
  """ "sm_90" for a Hopper GPU, the platform's name for anything else."""
  capability = compute_capability(device)
  return f"sm_{capability.replace('.', '')}" if capability else getattr(device, "platform", "unknown")
