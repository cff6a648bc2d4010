"""The tiny recipe's loss and grad norm per step equal tests/assets/losses/*.json bit for bit.

The files pin the numerics across commits: a refactor leaves them unchanged; a deliberate numerical
change regenerates them (`python scripts/golden_losses.py CASE --write`) in a commit of its own.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "golden_losses.py"
ASSETS = REPO / "tests" / "assets" / "losses"


@pytest.mark.parametrize("case", ["tiny_1dev", "tiny_8dev"])
def test_losses_equal_the_golden_file_bit_for_bit(case):
  golden = json.loads((ASSETS / f"{case}.json").read_text())
  done = subprocess.run([sys.executable, str(SCRIPT), case], capture_output=True, text=True, cwd=REPO, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  now = json.loads(done.stdout)
  assert now["overrides"] == golden["overrides"] and now["xla_flags"] == golden["xla_flags"]
  assert len(now["loss"]) == len(golden["loss"]) == 30
  for key in ("loss", "grad_norm"):
    differ = [i for i, (a, b) in enumerate(zip(now[key], golden[key])) if a != b]
    assert not differ, (
      f"{case}: {key} differs from the golden file from step {differ[0]} "
      f"(now {float.fromhex(now[key][differ[0]])!r}, golden {float.fromhex(golden[key][differ[0]])!r}); "
      f"a deliberate change regenerates {ASSETS.name}/{case}.json in a commit of its own"
    )
