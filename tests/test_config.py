"""Config loading: layering, overrides, and one clear error per bad input."""

import re

import pytest
import yaml

from MaxText.config import BASE_YML, load_config
from MaxText.config_schema import key_index
from MaxText.errors import UserError
from MaxText.sharding import mesh_shape

from conftest import REPO, TINY_RECIPE, train_cli


def test_base_yml_has_every_key_with_a_comment():
  lines = [line for line in BASE_YML.read_text().splitlines() if line and not line.startswith("#")]
  keys = {line.split(":")[0] for line in lines}
  assert keys == set(key_index())
  for line in lines:
    assert re.search(r"\s#\s\S", line), f"base.yml key without a one-line comment: {line}"


def test_layering_and_cli_overrides_win(tmp_path):
  parent = tmp_path / "parent.yml"
  parent.write_text(f"model_config: {REPO / 'configs/deepseek_v3/tiny.yml'}\nsteps: 7\nlearning_rate: 1.0e-3\n")
  child = tmp_path / "child.yml"
  child.write_text("base_config: parent.yml\nsteps: 9\n")
  cfg = load_config(child, ["learning_rate=5e-4", "num_experts=16"])
  assert cfg.train.steps == 9  # child over parent
  assert cfg.optimizer.learning_rate == 5e-4  # CLI over recipes, "5e-4" read as a number
  assert cfg.moe.num_experts == 16  # CLI over the model config
  assert cfg.model.model_name == "deepseek_v3-tiny"  # from the model config
  assert cfg.model.vocab_size == 256
  assert cfg.sources[-1] == str(child.resolve())


def test_config_is_read_only(tiny_config):
  cfg = tiny_config()
  with pytest.raises(Exception):
    cfg.train.steps = 3


@pytest.mark.parametrize(
  "override, message",
  [
    ("num_expert=4", "unknown config key 'num_expert' in the command line; did you mean 'num_experts'?"),
    ("steps=1.5", "steps=1.5 (from the command line) must be an integer"),
    ("scan_layers=maybe", "scan_layers='maybe' (from the command line) must be true or false"),
    ("learning_rate=fast", "learning_rate='fast' (from the command line) must be a number"),
    (
      "dtype=float8",
      "dtype='float8' (from the command line) is not allowed; choose one of: float32, bfloat16, float16",
    ),
    ("steps=0", "steps=0 (from the command line) must be >= 1"),
    ("adam_b1=1.5", "adam_b1=1.5 (from the command line) must be in 0..1"),
    ("num_experts_per_tok=16", "num_experts_per_tok: 16 is more than num_experts=8"),
    ("n_routing_groups=3", "n_routing_groups: num_experts=8 is not divisible by 3 groups"),
    ("moe_dispatch=capacity", "moe_dispatch=capacity needs capacity_factor > 0"),
    ("gradient_accumulation_steps=3", "per_device_batch_size=16 is not divisible by 3"),
    ("steps", "command-line argument 'steps' must be key=value"),
  ],
)
def test_bad_values_name_the_key_and_what_is_allowed(tiny_config, override, message):
  with pytest.raises(UserError) as e:
    tiny_config(override)
  assert message in str(e.value)
  assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
  with pytest.raises(UserError, match="does not exist"):
    load_config(tmp_path / "nope.yml")
  bad = tmp_path / "bad.yml"
  bad.write_text("steps: [1,\n")
  with pytest.raises(UserError, match="is not valid YAML at line"):
    load_config(bad)
  loop = tmp_path / "loop.yml"
  loop.write_text("base_config: loop.yml\n")
  with pytest.raises(UserError, match="base_config cycle"):
    load_config(loop)
  missing_model = tmp_path / "m.yml"
  missing_model.write_text("model_config: configs/deepseek_v3/none.yml\n")
  with pytest.raises(UserError, match="model_config: configs/deepseek_v3/none.yml .* not found"):
    load_config(missing_model)


def test_mesh_errors_give_the_numbers(tiny_config):
  cfg = tiny_config("ici_fsdp_parallelism=3", "ici_tensor_parallelism=2")
  with pytest.raises(
    UserError, match=r"ici mesh data=1 x fsdp=3 x expert=1 x tensor=2 has 6 devices but 8 are available"
  ):
    mesh_shape(cfg.mesh, 8)
  cfg = tiny_config("ici_fsdp_parallelism=-1", "ici_tensor_parallelism=3")
  with pytest.raises(UserError, match="8 devices are not divisible by the fixed axes' product 3"):
    mesh_shape(cfg.mesh, 8)
  cfg = tiny_config("ici_fsdp_parallelism=-1", "ici_expert_parallelism=2", "ici_tensor_parallelism=2")
  assert mesh_shape(cfg.mesh, 8) == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}


def test_effective_config_round_trips(tiny_config, tmp_path):
  cfg = tiny_config("steps=3")
  written = tmp_path / "config.yml"
  written.write_text(cfg.to_yaml())
  again = load_config(
    None,
    [
      f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
      for k, v in yaml.safe_load(written.read_text()).items()
    ],
  )
  assert again.to_flat_dict() == cfg.to_flat_dict()


@pytest.mark.parametrize(
  "args, message",
  [
    (
      [str(TINY_RECIPE), "num_expert=4"],
      "error: unknown config key 'num_expert' in the command line; did you mean 'num_experts'?",
    ),
    (["recipes/none.yml"], "does not exist"),
    ([str(TINY_RECIPE), "ici_tensor_parallelism=2"], "1 devices are not divisible by the fixed axes' product 2"),
    (["steps=3"], "the first argument must be a recipe .yml file"),
  ],
)
def test_cli_errors_are_one_line_exit_2_and_write_nothing(tmp_path, args, message):
  out = tmp_path / "runs"
  proc = train_cli(*args, f"base_output_directory={out}", timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr
  assert not out.exists()


@pytest.mark.parametrize("recipe", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "recipes").rglob("*.yml")))
def test_every_recipe_loads(recipe):
  cfg = load_config(REPO / recipe)
  assert cfg.model.model_name != "default"  # each recipe names a model config


@pytest.mark.parametrize("args", [["--help"], [str(TINY_RECIPE), "steps=3", "--help"]])
def test_help_anywhere_prints_usage_and_runs_nothing(tmp_path, args):
  out = tmp_path / "runs"
  proc = train_cli(*args, f"base_output_directory={out}", timeout=120)
  assert proc.returncode == 0 and "python -m MaxText.train" in proc.stdout, proc.stdout + proc.stderr
  assert not out.exists()


def test_a_run_directory_that_cannot_be_made_is_one_line_exit_2(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  proc = train_cli(str(TINY_RECIPE), "steps=1", f"base_output_directory={blocker / 'runs'}")
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: cannot create the run directory {blocker}/runs/"), lines
  assert lines[0].endswith("set base_output_directory to a writable directory"), proc.stderr
  assert blocker.read_text() == "not a directory" and sorted(tmp_path.iterdir()) == [blocker]


def test_a_run_directory_that_fails_at_a_deeper_level_leaves_no_empty_parents(tmp_path):
  from MaxText.train import make_run_dir

  base = tmp_path / "new" / "runs"
  with pytest.raises(UserError, match="cannot create the run directory"):
    make_run_dir(base / ("x" * 300), resumable=False)  # NAME_MAX is 255: new/ and runs/ are made, then it fails
  assert list(tmp_path.iterdir()) == []
  assert make_run_dir(base / "ok", resumable=False).is_dir()  # the same parents are made when the name is fine
