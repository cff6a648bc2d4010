"""Shared test setup: 8 host CPU devices (set before JAX starts) and small configs."""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # `make test` sets it already
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "deepseek_v3_tiny.yml"


def train_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """`python -m MaxText.train ARGS` in a fresh process on the CPU, with none of the caller's environment."""
  return subprocess.run(
    [sys.executable, "-m", "MaxText.train", *args],
    cwd=REPO,
    env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.fixture
def tiny_config():
  """Loads the tiny recipe with overrides, writing runs under a temp dir."""
  from MaxText.config import load_config

  def load(*overrides: str, recipe=TINY_RECIPE):
    return load_config(recipe, list(overrides))

  return load
