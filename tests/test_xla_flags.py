"""XLA flag and environment presets (MaxText/runtime_env.py, MaxText/xla_flags.py): names read from the
installed jaxlib, clear errors before JAX starts, the flags and environment in force recorded in the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText import runtime_env, xla_flags
from MaxText.errors import UserError

from conftest import REPO, TINY_RECIPE

PLUGIN_SITE = Path(os.environ.get("MAXTEXT_GPU_AOT_SITE", REPO / ".venv" / "gpu-aot"))
REFERENCE = Path("/work/shared/reference/xla_gpu_flags_jaxlib_0.11.2.txt")
# A small run: a 2-layer model, one step, no checkpoint.
SMALL = (
  "steps=1",
  "max_target_length=8",
  "per_device_batch_size=1",
  "base_num_decoder_layers=2",
  "mtp_num_layers=0",
  "remat_policy=none",
  "enable_checkpointing=false",
  "enable_tensorboard=false",
  "compile_heartbeat_seconds=0",
)


def _preset_flags() -> dict[str, list[str]]:
  return {
    name: [n for n, _ in runtime_env.parse_flags(" ".join(flags), name)]
    for name, (_, flags) in runtime_env.XLA_PRESETS.items()
  }


def test_scan_splits_packed_literals_and_keeps_names_with_xla_inside(tmp_path):
  lib = tmp_path / "lib.so"
  lib.write_bytes(
    b"\x00\x01xla_gpu_ptx_filexla_gpu_algorithm_denylist_path\x00junk "
    b"xla_gpu_enable_xla_runtime_executable\x00XLA_FLAGS\x00"
  )
  assert xla_flags.scan(lib) == {
    "xla_gpu_ptx_file",
    "xla_gpu_algorithm_denylist_path",
    "xla_gpu_enable_xla_runtime_executable",
  }


def test_installed_jaxlib_knows_the_flags_we_rely_on():
  (lib,) = [lib for lib in xla_flags.libraries() if lib.label.startswith("jaxlib")]
  assert lib.path.name == "libjax_common.so"
  # CPU and GPU flags are both registered in jaxlib (the debug options are shared by every backend).
  assert {"xla_force_host_platform_device_count", "xla_gpu_enable_latency_hiding_scheduler", "xla_dump_to"} <= lib.names
  assert "xla_made_up_flag" not in lib.names


def test_every_preset_flag_is_known_to_jaxlib_and_the_cuda_plugin_and_the_reference_list():
  libs = xla_flags.libraries()
  if (PLUGIN_SITE / "jax_plugins").is_dir():  # the compile-only CUDA plugin lives outside the main environment
    for so in sorted((PLUGIN_SITE / "jax_plugins").glob("xla_cuda*/*.so")):
      libs.append(xla_flags.Library(f"{so.parent.name} plugin", so, xla_flags.scan(so)))
  reference = set(REFERENCE.read_text().split()) if REFERENCE.is_file() else None
  for preset, names in _preset_flags().items():
    for name in names:
      for lib in libs:
        assert name in lib.names, f"preset {preset}: --{name} unknown to {lib.label}"
      if reference is not None:
        assert name in reference, f"preset {preset}: --{name} not in {REFERENCE}"


def test_names_are_cached_by_library_and_version(tmp_path, monkeypatch):
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  lib = tmp_path / "lib.so"
  lib.write_bytes(b"\x00xla_one\x00")
  assert xla_flags.names_in(lib, "9.9") == {"xla_one"}
  (cached,) = tmp_path.glob("xla_flag_names-*.json")
  cached.write_text(json.dumps({"names": ["xla_from_cache"]}))
  assert xla_flags.names_in(lib, "9.9") == {"xla_from_cache"}  # read back, not scanned again
  assert xla_flags.names_in(lib, "9.8") == {"xla_one"}  # another jaxlib version: scanned again


class _Train:
  def __init__(self, **kw):
    self.xla_flag_presets = kw.get("xla_flag_presets", "")
    self.xla_flags = kw.get("xla_flags", "")
    self.env_presets = kw.get("env_presets", "")
    self.env_vars = kw.get("env_vars", "")


def test_planned_order_later_wins_and_validation():
  cfg = _Train(
    xla_flag_presets="latency_hiding,collective_combine",
    xla_flags="--xla_gpu_all_gather_combine_threshold_bytes=1",
    env_presets="mem_fraction_95",
    env_vars="XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 NCCL_DEBUG=WARN",
  )
  flags, env = runtime_env.planned(cfg, environ={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert [n for n, _, _ in flags][:2] == [
    "xla_force_host_platform_device_count",
    "xla_gpu_enable_latency_hiding_scheduler",
  ]
  assert flags[-1] == (
    "xla_gpu_all_gather_combine_threshold_bytes",
    "--xla_gpu_all_gather_combine_threshold_bytes=1",
    "xla_flags",
  )
  assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9", "NCCL_DEBUG": "WARN"}
  notes = runtime_env.validate(flags, [lib for lib in xla_flags.libraries() if lib.label.startswith("jaxlib")])
  assert notes and "no CUDA plugin" in notes[0]
  with pytest.raises(
    UserError,
    match=r"^XLA flag --xla_gpu_enable_latency_hiding_schedular \(from xla_flags\) is not known to jaxlib 0\.11\.2",
  ):
    runtime_env.validate([("xla_gpu_enable_latency_hiding_schedular", "", "xla_flags")])


@pytest.mark.parametrize(
  "override, message",
  [
    ("xla_flag_presets=latency_hiding,fast", "xla_flag_presets: unknown preset 'fast'; choose from: latency_hiding,"),
    ("env_presets=nccl", "env_presets: unknown preset 'nccl'; choose from: mem_fraction_95,"),
    (
      "xla_flags=xla_gpu_enable_command_buffer=",
      "xla_flags: 'xla_gpu_enable_command_buffer=' is not an XLA flag; write --xla_name=value",
    ),
    (
      "env_vars=XLA_FLAGS=--xla_dump_to=/tmp",
      "env_vars: set XLA flags with xla_flags or xla_flag_presets, not XLA_FLAGS",
    ),
    ("env_vars=NCCL_DEBUG", "env_vars: 'NCCL_DEBUG' is not NAME=VALUE"),
  ],
)
def test_config_checks_names_and_syntax(tiny_config, override, message):
  with pytest.raises(UserError) as e:
    tiny_config(override)
  assert str(e.value).startswith(message)


def _train(tmp_path, *args, env=None):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **(env or {})}
  cmd = [
    sys.executable,
    "-m",
    "MaxText.train",
    str(TINY_RECIPE),
    *SMALL,
    f"base_output_directory={tmp_path}",
    "run_name=r",
    *args,
  ]
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("where", ["xla_flags", "the XLA_FLAGS environment variable"])
def test_made_up_flag_is_one_line_exit_2_before_jax_starts(tmp_path, where):
  if where == "xla_flags":
    proc = _train(tmp_path, "xla_flags=--xla_made_up_flag=1")
  else:
    proc = _train(tmp_path, env={"XLA_FLAGS": "--xla_made_up_flag=1"})
  assert proc.returncode == 2, proc.stderr[-2000:]
  # Our line, not XLA's abort (which would name no jaxlib version and exit by a signal).
  assert proc.stderr.splitlines() == [
    f"error: XLA flag --xla_made_up_flag (from {where}) is not known to jaxlib 0.11.2 (libjax_common.so); "
    "XLA would abort on it: remove it or use the name this version has"
  ]
  assert not (tmp_path / "r").exists()


def test_presets_reach_xla_and_are_recorded_in_the_run(tmp_path):
  proc = _train(
    tmp_path,
    "xla_flag_presets=latency_hiding,collective_combine",
    "xla_flags=--xla_gpu_enable_command_buffer=",
    "env_presets=nccl_no_nvls",
    "env_vars=NCCL_DEBUG=WARN",
    env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"},
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  expected = (
    "--xla_cpu_enable_fast_math=false --xla_gpu_enable_latency_hiding_scheduler=true "
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728 --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728 "
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728 --xla_gpu_enable_command_buffer="
  )
  recorded = json.loads((tmp_path / "r" / "environment.json").read_text())["environment_in_force"]
  assert recorded["XLA_FLAGS"] == expected
  assert recorded["NCCL_DEBUG"] == "WARN" and recorded["NCCL_NVLS_ENABLE"] == "0"
  assert f"XLA_FLAGS={expected!r}" in proc.stdout  # and in the log
  assert (
    "note: GPU flags from xla_flag_presets latency_hiding, xla_flag_presets collective_combine, "
    "xla_flags but no CUDA plugin" in proc.stdout
  )


def test_apply_refuses_once_jax_has_started(monkeypatch):
  import jax

  jax.devices()  # the backend is up in this process
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  with pytest.raises(UserError, match="JAX has already started, so XLA_FLAGS would not take effect"):
    runtime_env.apply(_Train(xla_flag_presets="latency_hiding"))
  before = os.environ["XLA_FLAGS"]
  # nothing to change (the environment's flags, each once, as XLA reads them): fine,
  # and the environment is left as it was
  assert runtime_env.apply(_Train()) == {"xla_flags": runtime_env._merged(before), "env": {}, "notes": []}
  assert os.environ["XLA_FLAGS"] == before


def test_apply_treats_repeated_environment_flags_as_no_change(monkeypatch):
  import jax

  jax.devices()
  # make test prepends its device count to any XLA_FLAGS CI already set, so the same flag can come twice
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8  --xla_force_host_platform_device_count=8")
  assert runtime_env.apply(_Train())["xla_flags"] == "--xla_force_host_platform_device_count=8"
