"""benchmarks/machine.py: what a benchmark ran on. describe(devices=False) leaves JAX unimported (launchers call it
before their children take the GPU); nvidia-smi is a stand-in script here, so the GPU fields are known."""

import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import machine  # noqa: E402

GPU_LINE = "NVIDIA H100 80GB HBM3, 570.86.15, 81559 MiB"
TOPOLOGY = "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X "
# In a fresh interpreter: describe(devices=False) with jax importable but not imported, then what it returned
# and whether jax (or any jax submodule) got imported.
PROBE = f"""
import json, sys
sys.path.insert(0, {str(REPO / "benchmarks")!r})
assert not any(m.startswith("jax") for m in sys.modules)
import machine
info = machine.describe(devices=False, topology=True, packages=("jax", "jaxlib", "no-such-package-xyz"))
print(json.dumps({{"info": info, "jax_imported": sorted(m for m in sys.modules if m.startswith("jax"))}}))
"""


def fake_nvidia_smi(bin_dir, rc: int = 0):
  """An nvidia-smi on PATH that answers the GPU query and `topo -m` as one with two H100s would (or fails with rc)."""
  bin_dir.mkdir()
  script = bin_dir / "nvidia-smi"
  script.write_text(
    "#!/bin/sh\n"
    f"[ {rc} -ne 0 ] && echo 'NVIDIA-SMI has failed' && exit {rc}\n"
    f'if [ "$1" = topo ]; then printf \'{TOPOLOGY}\\n\'; else echo "{GPU_LINE}"; echo "{GPU_LINE}"; fi\n'
  )
  script.chmod(0o755)
  return bin_dir


def probe(path: str) -> dict:
  env = {**os.environ, "PATH": path}
  proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_devices_jax_is_not_imported_and_the_gpu_comes_from_nvidia_smi(tmp_path):
  out = probe(str(fake_nvidia_smi(tmp_path / "bin")))
  assert out["jax_imported"] == []
  info = out["info"]
  assert set(info) == {"date", "python", "jax", "jaxlib", "no-such-package-xyz", "gpu", "device", "topology"}
  assert info["gpu"] == f"{GPU_LINE}\n{GPU_LINE}"  # one line per GPU
  assert info["device"] == "NVIDIA H100 80GB HBM3"  # the name field: what JAX calls this GPU's device_kind
  assert info["topology"] == TOPOLOGY  # the header row keeps its leading tab
  assert info["jax"] == jax.__version__ and info["jaxlib"] is not None and info["no-such-package-xyz"] is None
  assert info["python"] == sys.version.split()[0] and len(info["date"]) == 10 and info["date"][4] == "-"


@pytest.mark.parametrize("case", ["absent", "failing"])
def test_without_nvidia_smi_there_is_no_gpu(tmp_path, case):
  path = str(tmp_path / "empty") if case == "absent" else str(fake_nvidia_smi(tmp_path / "bin", rc=9))
  out = probe(path)
  assert out["jax_imported"] == []
  info = out["info"]
  assert info["gpu"] is None and info["device"] is None
  assert info["topology"].startswith("unavailable: ")


def test_with_devices_the_device_is_jax_device_kind():
  info = machine.describe()
  first = jax.devices()[0]
  assert info["device"] == first.device_kind
  assert info["devices"] == jax.device_count() and info["platform"] == first.platform
  assert info["jax"] == jax.__version__ and "topology" not in info and "torch" not in info
  assert set(info) == {"date", "python", "jax", "jaxlib", "gpu", "device", "devices", "platform"}
