"""One validation phase (MaxText/validate.py): every bad input is one `error:` line, exit code 2, nothing written.

The schema walk is generated from MaxText/config_schema.py: for every key a value of the wrong type, one
outside its domain and an empty one, checked in-process (fast); a handful go through the real CLIs.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from MaxText import validate
from MaxText.config import BASE_YML, load_config
from MaxText.config_schema import domain, key_index
from MaxText.errors import UserError

from conftest import REPO, TINY_RECIPE

PLUGIN_SITE = REPO / ".venv" / "gpu-aot"
has_plugin = (PLUGIN_SITE / "jax_plugins").is_dir() or "MAXTEXT_GPU_AOT_SITE" in os.environ
# Free-text keys whose "" is a documented value (off, none, or used only by a dataset type that checks it).
EMPTY_IS_DOCUMENTED = {
  "batch_size_schedule",
  "learning_rate_phases",
  "dataset_name",
  "train_split",
  "grain_train_files",
  "hf_path",
  "hf_data_dir",
  "hf_train_files",
  "train_data_columns",
  "run_name",
  "mtp_loss_scaling_factor_schedule",
  "routed_bias_update_rate_schedule",
  "xla_flag_presets",
  "xla_flags",
  "env_presets",
  "env_vars",
}


def _wrong_type(f: dataclasses.Field):
  return {bool: "maybe", int: "abc", float: "abc", str: "123"}[f.type]


def _outside(f: dataclasses.Field) -> str | None:
  meta = f.metadata
  if "choices" in meta or "registry" in meta:
    return "no_such_choice"
  if meta.get("label"):
    return "a/b"
  if "ge" in meta:
    return str(meta["ge"] - 3 if "off" in meta else meta["ge"] - 1)
  if "gt" in meta:
    return str(meta["gt"] - 3 if "off" in meta else meta["gt"])
  if "le" in meta:
    return str(meta["le"] + 1)
  return None


def _cases():
  for key, (_, f) in key_index().items():
    yield pytest.param(key, _wrong_type(f), id=f"{key}-type")
    if (bad := _outside(f)) is not None:
      yield pytest.param(key, bad, id=f"{key}-domain")
    choices = f.metadata.get("choices") or ()
    if f.type is not str or not ("" in choices or key in EMPTY_IS_DOCUMENTED or f.metadata.get("path") == "optional"):
      if key != "quantization":  # "" (off) is its documented value
        yield pytest.param(key, "", id=f"{key}-empty")


@pytest.mark.parametrize("key, value", list(_cases()))
def test_every_key_refuses_a_bad_value_in_one_line(key, value, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UserError) as e:
    cfg = load_config(TINY_RECIPE, [f"base_output_directory={tmp_path / 'out'}", f"{key}={value}"])
    validate.before_start(cfg)
  message = str(e.value)
  assert "\n" not in message and message.strip()
  assert key in message or "XLA" in message, message
  assert list(tmp_path.iterdir()) == []


def test_every_numeric_and_path_key_shows_its_domain_in_base_yml():
  lines = {m.group(1): m.group(2) for m in re.finditer(r"^([a-z0-9_]+):.*?\s#\s(.*)$", BASE_YML.read_text(), re.M)}
  for key, (_, f) in key_index().items():
    if (d := domain(f)) is not None:
      assert lines[key].startswith(f"[{d}] "), f"base.yml: {key} should show [{d}]"


@pytest.mark.parametrize(
  "overrides, devices, message",
  [
    (
      ["ici_fsdp_parallelism=7"],
      7,
      "ici_fsdp_parallelism=7 does not divide embed=64 of params/dense_layers/ffn/wi_0; use a divisor of 64",
    ),
    ([], 7, "ici_fsdp_parallelism=-1 (fills fsdp=7 of 7 devices) does not divide embed=64"),
    (
      ["ici_expert_parallelism=3", "ici_fsdp_parallelism=2"],
      6,
      "moe_dispatch=sort: ici_expert_parallelism=3 does not divide exp=8 of params/moe_layers/ffn/wi_0",
    ),
    (["ici_tensor_parallelism=3", "ici_fsdp_parallelism=-1"], 3, "ici_tensor_parallelism=3 does not divide"),
    (
      ["moe_dispatch=capacity", "capacity_factor=1.25", "ici_expert_parallelism=-1", "ici_fsdp_parallelism=1"],
      6,
      "moe_dispatch=capacity: ici_expert_parallelism=-1 (fills expert=6 of 6 devices) does not divide exp=8",
    ),
  ],
)
def test_sharding_is_checked_from_shapes_for_every_dispatcher(tiny_config, overrides, devices, message):
  cfg = tiny_config(*overrides)
  with pytest.raises(UserError) as e:
    validate.before_start(cfg)
    validate.devices(cfg, devices, platform="cpu")
  assert str(e.value).startswith(message), str(e.value)


def test_a_mesh_that_divides_every_tensor_passes(tiny_config):
  assert validate.devices(tiny_config(), 8, platform="cpu")["fsdp"] == 8
  assert validate.devices(tiny_config("ici_expert_parallelism=2"), 8, platform="cpu")["expert"] == 2


def test_hopper_kernels_are_refused_off_hopper_naming_what_runs(tiny_config):
  cfg = tiny_config("moe_gmm_backend=mosaic", "dtype=bfloat16")
  with pytest.raises(UserError, match=r"cannot run on cpu; here choose moe_gmm_backend=xla or moe_gmm_backend=auto$"):
    validate.backend(cfg, "cpu")
  with pytest.raises(UserError, match="cannot run on NVIDIA B200"):
    validate.backend(cfg, "gpu", "NVIDIA B200")
  validate.backend(cfg, "gpu", "NVIDIA H200")
  # The advice for mosaic with float32 leads to a backend that runs everywhere.
  with pytest.raises(UserError, match="set moe_gmm_backend=xla .any device and dtype."):
    tiny_config("moe_gmm_backend=mosaic")


def test_load_parameters_path_must_be_a_checkpoint(tiny_config, tmp_path):
  with pytest.raises(UserError, match="load_parameters_path .* does not exist"):
    validate.inputs(tiny_config(f"load_parameters_path={tmp_path / 'none'}"))
  with pytest.raises(UserError, match="is not a checkpoint step directory"):
    validate.inputs(tiny_config(f"load_parameters_path={tmp_path}"))


def _cli(module, *args, cwd, env=None):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
  return subprocess.run(
    [sys.executable, "-m", module, *map(str, args)],
    cwd=cwd,
    env={**env, "PYTHONPATH": str(REPO)},
    capture_output=True,
    text=True,
    timeout=300,
  )


def _assert_one_error(proc, cwd, message=""):
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert proc.stdout == "", proc.stdout
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
  assert list(cwd.iterdir()) == [], list(cwd.iterdir())


SEVEN = {"XLA_FLAGS": "--xla_force_host_platform_device_count=7"}


@pytest.mark.parametrize(
  "args, env, message",
  [
    (["ici_fsdp_parallelism=7"], SEVEN, "ici_fsdp_parallelism=7 does not divide embed=64"),
    (["ici_expert_parallelism=7"], SEVEN, "moe_dispatch=sort: ici_expert_parallelism=7 does not divide exp=8"),
    (["moe_gmm_backend=mosaic", "dtype=bfloat16"], None, "cannot run on cpu; here choose moe_gmm_backend=xla"),
    (["load_parameters_path=missing"], None, "load_parameters_path missing does not exist"),
    (["capacity_factor=-3"], None, "capacity_factor=-3.0 (from the command line) must be -1 or > 0"),
    (["base_output_directory="], None, "base_output_directory (from the command line) is empty"),
    ([], {"XLA_FLAGS": "--xla_gpu_enable_xla_runtime_executable=true"}, "is not known to jaxlib"),
  ],
)
def test_trainer_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, env, message):
  out = [] if any(a.startswith("base_output_directory=") for a in args) else [f"base_output_directory={tmp_path}"]
  proc = _cli("MaxText.train", TINY_RECIPE, "steps=1", *out, *args, cwd=tmp_path, env=env)
  _assert_one_error(proc, tmp_path, message)


@pytest.mark.skipif(not has_plugin, reason="the planner needs the CUDA plugin (make install)")
@pytest.mark.parametrize(
  "args, message",
  [
    (["--gpu", "h200", "--num-gpus", "7"], "ici_fsdp_parallelism=-1 (fills fsdp=7 of 7 devices) does not divide"),
    (["--gpu", "b200", "--num-gpus", "8", "moe_gmm_backend=mosaic", "dtype=bfloat16"], "cannot run on NVIDIA B200"),
    (["--gpu", "h200", "--num-gpus", "8", "--json", "no/such/dir/plan.json"], "its parent directory"),
    (["--gpu", "h200", "--num-gpus", "8", "--memory-fraction", "2"], "--memory-fraction 2.0 must be in (0, 1]"),
  ],
)
def test_planner_bad_input_is_one_line_exit_2(tmp_path, args, message):
  _assert_one_error(_cli("MaxText.aot", TINY_RECIPE, *args, cwd=tmp_path), tmp_path, message)


def test_planner_takes_help_after_the_recipe(tmp_path):
  proc = _cli("MaxText.aot", TINY_RECIPE, "--help", cwd=tmp_path)
  assert proc.returncode == 0 and "usage: python -m MaxText.aot" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
  "module, args, message",
  [
    ("MaxText.convert.hf_to_orbax", ["--hf-dir", "none", "--out", "out"], "none"),
    ("MaxText.convert.hf_to_orbax", ["--hf-dir", "x", "--out", "out", "--dtype", "int8"], "invalid choice"),
    ("MaxText.convert.orbax_to_hf", ["--checkpoint", "none", "--out", "out"], "none"),
    ("MaxText.score", ["--checkpoint", "none", "--input-ids", "ids.npy", "--output", "no/dir/l.npy"], "no/dir"),
  ],
)
def test_converters_and_scorer_bad_input_is_one_line_exit_2(tmp_path, module, args, message):
  _assert_one_error(_cli(module, *args, cwd=tmp_path), tmp_path, message)


def test_xla_flags_are_checked_by_xla_itself_and_the_verdict_is_cached(tmp_path, monkeypatch):
  from MaxText import xla_flags

  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  removed = "--xla_gpu_enable_xla_runtime_executable=true"  # its name is still text inside libjax_common.so
  assert xla_flags.probe([removed]) == [["xla_gpu_enable_xla_runtime_executable", "unknown"]]
  assert xla_flags.probe(["--xla_force_host_platform_device_count=8", "--xla_gpu_enable_command_buffer="]) == []
  assert xla_flags.probe(["--xla_gpu_enable_command_buffer=BOGUS"]) == [["xla_gpu_enable_command_buffer", "value"]]
  assert len(list(tmp_path.glob("xla_flag_probe-*.json"))) == 3
  assert not list(tmp_path.glob("*.tmp"))


def test_tensorboard_without_tensorboardx_is_one_line(tiny_config, monkeypatch):
  """enable_tensorboard=true where tensorboardX is missing (e.g. a bare GPU image): refused before anything is
  written, naming the two ways out; with it off the same config passes."""
  import importlib.util

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else real(name, *a))
  with pytest.raises(UserError, match=r"^enable_tensorboard=true needs tensorboardX.*enable_tensorboard=false"):
    validate.packages(tiny_config("enable_tensorboard=true"))
  validate.packages(tiny_config("enable_tensorboard=false"))
