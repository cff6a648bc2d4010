"""What a benchmark ran on, for its results file: date, Python and package versions, the GPU and driver as
nvidia-smi reports them, and the device.

  import machine                     # a script's own directory, benchmarks/, is on sys.path
  results = {"machine": machine.describe(), ...}

The device is "device" either way: JAX's device_kind by default, or with devices=False the GPU name from
nvidia-smi (for NVIDIA GPUs the same string). Launchers whose children use the GPU (train_recipe.py runs
`python -m MaxText.train`, remat_offload.py its workers) pass devices=False, and then this module does not
import JAX at all: a JAX GPU client in the parent would hold a CUDA context and memory on the GPU the child
measures.
"""

import subprocess
import sys
import time
from importlib import metadata

GPU_QUERY = ("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")


def nvidia_smi(*args: str) -> str:
  """nvidia-smi's output; raises OSError or subprocess.SubprocessError when it is missing or fails."""
  return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def version(package: str) -> str | None:
  """The installed version of a distribution, from its metadata (no import: importing torch or jax costs seconds)."""
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


def describe(*, devices: bool = True, topology: bool = False, packages: tuple = ("jax", "jaxlib")) -> dict:
  """The machine: "date", "python", one key per package (its version, None if not installed), "gpu" (nvidia-smi's
  name, driver and memory, one line per GPU; None without one), "device", and with devices=True also "devices"
  (JAX's device count) and "platform"; with topology=True "topology" (`nvidia-smi topo -m`)."""
  info = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0]}
  info.update({package: version(package) for package in packages})
  try:
    info["gpu"] = nvidia_smi(*GPU_QUERY).strip() or None
  except (OSError, subprocess.SubprocessError):
    info["gpu"] = None
  if devices:
    import jax

    first = jax.devices()[0]
    info.update(device=first.device_kind, devices=jax.device_count(), platform=first.platform)
  else:
    info["device"] = info["gpu"].splitlines()[0].split(",")[0].strip() if info["gpu"] else None
  if topology:
    try:
      # newlines only: the matrix's header row starts with a tab, under the column of row names
      info["topology"] = nvidia_smi("topo", "-m").strip("\n") or "unavailable: no output"
    except (OSError, subprocess.SubprocessError) as e:
      info["topology"] = f"unavailable: {e}"
  return info
