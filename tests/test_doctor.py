"""`python -m MaxText.doctor`: the report, its JSON form, exit codes, and how missing packages are marked."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax

from MaxText import doctor

REPO = Path(__file__).resolve().parents[1]


def run_doctor(*args: str) -> subprocess.CompletedProcess:
  # A GPU or an odd platform choice in the caller's environment must not change what the tests see.
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-m", "MaxText.doctor", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )


def test_reports_jax_version_and_cpu_platform():
  r = run_doctor()
  assert r.returncode == 0, r.stdout + r.stderr
  jax_line = next(line for line in r.stdout.splitlines() if line.split()[1:2] == ["jax"])
  assert jax_line.startswith("ok") and jax.__version__ in jax_line
  assert re.search(r"^ok\s+jax backend\s+platform cpu:", r.stdout, re.MULTILINE), r.stdout
  assert "required pieces: all usable" in r.stdout


def test_json_report():
  r = run_doctor("--json")
  assert r.returncode == 0, r.stdout + r.stderr
  report = json.loads(r.stdout)
  assert report["ok"] is True
  checks = {c["name"]: c for c in report["checks"]}
  assert checks["jax"]["status"] == "ok" and checks["jax"]["required"] is True
  assert jax.__version__ in checks["jax"]["detail"]
  assert checks["JAX_PLATFORMS"] == {"name": "JAX_PLATFORMS", "status": "ok", "detail": "cpu", "required": False}


def test_unknown_argument_is_one_error_line_and_exit_2():
  r = run_doctor("--frobnicate")
  assert r.returncode == 2
  lines = r.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:") and "--frobnicate" in lines[0], r.stderr
  assert r.stdout == ""


def test_missing_optional_package_is_missing_but_not_required(monkeypatch):
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "tokamax" else real_find_spec(name, *a)
  )
  checks = {c.name: c for c in doctor.collect()}
  tokamax = checks["tokamax"]
  assert tokamax.status == "missing" and not tokamax.required
  assert "moe_gmm_backend=tokamax" in tokamax.detail
  assert doctor.usable(list(checks.values()))


def test_required_piece_not_ok_makes_report_unusable():
  checks = [
    doctor.Check("python", "ok", "", required=True),
    doctor.Check("jax backend", "unusable", "no devices", required=True),
  ]
  assert not doctor.usable(checks)
  assert "required pieces not usable: jax backend (unusable)" in doctor.format_text(checks)


def test_hopper_only_when_every_gpu_is_sm_90():
  assert doctor.check_hopper({"9.0"}).status == "ok"
  assert doctor.check_hopper({"9.0", "8.0"}).status == "unusable"
  assert doctor.check_hopper({None}).status == "unusable"


def test_quantization_line_says_what_runs_on_these_gpus(monkeypatch):
  from MaxText import gmm

  class Gpu:
    platform = "gpu"

    def __init__(self, capability):
      self.compute_capability = capability

  monkeypatch.setattr(gmm, "unavailable", lambda name: None)  # as with a jax that has Pallas Mosaic GPU
  blackwell = doctor.check_quantization([Gpu("10.0")] * 8)
  assert "mxfp8_impl=auto -> block_scaled" in blackwell.detail and "fp8 kernels need sm_90" in blackwell.detail
  hopper = doctor.check_quantization([Gpu("9.0")] * 8)
  assert "mxfp8_impl=auto -> emulated" in hopper.detail and "Hopper kernels (moe_gmm_backend=mosaic)" in hopper.detail
  mixed = doctor.check_quantization([Gpu("10.0"), Gpu("9.0")])  # not every GPU has either
  assert "-> emulated" in mixed.detail and "fp8 kernels need sm_90" in mixed.detail
  assert "-> emulated" in doctor.check_quantization(jax.devices()).detail


def test_mosaic_tile_table_named_for_hopper_gpus(monkeypatch):
  from MaxText import gmm

  class Gpu:
    platform = "gpu"
    compute_capability = "9.0"

    def __init__(self, kind):
      self.device_kind = kind

  monkeypatch.setattr(gmm, "unavailable", lambda name: None)  # as with a jax that has Pallas Mosaic GPU
  (tiles,) = [c for c in doctor.check_moe_backends([Gpu("NVIDIA H100 80GB HBM3")] * 8) if c.name == "mosaic tiles"]
  assert tiles.detail.startswith("Mosaic tile table mosaic_tiles_h100.json")
  (tiles,) = [c for c in doctor.check_moe_backends([Gpu("NVIDIA GH200 480GB")]) if c.name == "mosaic tiles"]
  assert tiles.detail.startswith("Mosaic tile table mosaic_tiles_h200.json")
  assert not [c for c in doctor.check_moe_backends(jax.devices()) if c.name == "mosaic tiles"]  # CPU: no Mosaic


def test_version_tuple_compares_like_jaxlib():
  assert doctor.version_tuple("0.12.0.1") == (0, 12, 0, 1)
  assert doctor.version_tuple("0.11.2.dev20260101") == (0, 11, 2)
  assert doctor.version_tuple("2.0rc1") < doctor.version_tuple("2.0.1")


def test_minimum_versions_match_requirements_txt():
  pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)>=([0-9.]+)", (REPO / "requirements.txt").read_text(), re.MULTILINE))
  assert pins == doctor.MIN_VERSIONS
