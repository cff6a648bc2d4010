"""profiler=xplane: a traced window of training steps, summarised by the model's named scopes."""

import json

import pytest

from MaxText import profile
from MaxText.errors import UserError
from MaxText.train import train

SMALL = (
  "max_target_length=16",
  "per_device_batch_size=2",
  "remat_policy=none",
  "enable_checkpointing=false",
  "enable_tensorboard=false",
)


@pytest.mark.parametrize(
  "op_name, label",
  [
    ("jit(step)/jit(main)/transpose(jvp(decoder))/moe/gmm/dot_general", "bwd gmm"),
    ("jit(step)/jvp(decoder)/layers_0/attention/dot_general", "fwd attention"),
    ("jit(step)/jvp(mtp)/moe/router/top_k", "fwd router"),  # the innermost scope wins
    ("jit(step)/optimizer/mul", "optimizer"),
    ("jit(step)/add", None),
    ("jit(step)/jvp(attention_outer)/x", None),  # a scope name must match whole
  ],
)
def test_scope_label(op_name, label):
  assert profile.scope_label(op_name) == label


def test_profiled_steps_are_summarised_by_scope(tiny_config, tmp_path, capsys):
  cfg = tiny_config(
    *SMALL,
    "steps=4",
    "profiler=xplane",
    "skip_first_n_steps_for_profiler=1",
    "profiler_steps=2",
    f"base_output_directory={tmp_path}",
    "run_name=p",
  )
  assert len(train(cfg)) == 4
  directory = tmp_path / "p" / "profile"
  assert list(directory.rglob("*.xplane.pb")), "the trace itself is kept for TensorBoard/XProf"
  summary = json.loads((directory / "profile_summary.json").read_text())
  assert summary["steps"] == 2 and summary["step_ms_measured"] > 0
  scopes = summary["by_scope_ms"]
  for part in ("fwd gmm", "bwd gmm", "fwd attention", "bwd attention", "optimizer"):
    assert scopes.get(part, 0) > 0, (part, scopes)
  assert abs(sum(scopes.values()) - summary["kernel_ms_per_step"]) < 1e-6 * summary["kernel_ms_per_step"] + 1e-9
  assert 0 < summary["device_busy_ms_per_step"] <= summary["kernel_ms_per_step"] + 1e-9
  assert "profile of steps 1-2" in capsys.readouterr().out

  (directory / "profile_summary.md").unlink()  # written again from the files the run left
  assert profile.main([str(directory)]) == 0
  assert "| fwd gmm |" in (directory / "profile_summary.md").read_text()


def test_profile_window_past_the_run_is_refused_before_the_run_directory(tiny_config, tmp_path):
  cfg = tiny_config(
    *SMALL,
    "steps=3",
    "profiler=xplane",
    "skip_first_n_steps_for_profiler=2",
    "profiler_steps=2",
    f"base_output_directory={tmp_path}",
    "run_name=p",
  )
  with pytest.raises(UserError, match="steps 2-3 would be profiled but the run ends at step 2"):
    train(cfg)
  assert not (tmp_path / "p").exists()


def test_summary_command_needs_a_profile_directory(tmp_path, capsys):
  assert profile.main([str(tmp_path)]) == 2
  assert "usage: python -m MaxText.profile PROFILE_DIR" in capsys.readouterr().err
