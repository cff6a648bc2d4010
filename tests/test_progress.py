"""The heartbeat printed during long compiles (train loop and planner)."""

import time

from MaxText.progress import progress


def test_heartbeat_while_the_block_runs_and_time_at_the_end(capsys):
  with progress("Compiling the training step", 0.05):
    time.sleep(0.3)
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "Compiling the training step ..."
  assert any(line.startswith("  still compiling the training step (") for line in lines[1:-1])
  assert lines[-1].startswith("Compiling the training step: done in ")


def test_zero_interval_prints_no_heartbeat(capsys):
  with progress("Compiling", 0):
    time.sleep(0.1)
  first, last = capsys.readouterr().out.splitlines()
  assert first == "Compiling ..." and last.startswith("Compiling: done in ")
