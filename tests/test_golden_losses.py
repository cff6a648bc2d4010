"""The tiny recipe's loss and grad norm per step equal tests/assets/losses/ bit for bit.

The files pin the numerics across commits: a refactor leaves them unchanged; a deliberate numerical
change regenerates them (`python scripts/golden_losses.py CASE --write`) in a commit of its own.

XLA:CPU rounds the last bits differently on different CPUs (its YNNPACK kernels are chosen at run time;
scripts/golden_losses.py says more), so each golden file records the CPU that wrote it. On a CPU with a
file of its own the comparison is bit for bit. On another, the values must be within RTOL of every
CPU's file: two machines differed by 2.3e-7 relative at most over the 30 steps, while a change to the
math (a dtype, a formula, a lost term) moves them by 1e-4 or more.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "golden_losses.py"
sys.path.insert(0, str(SCRIPT.parent))
import golden_losses  # noqa: E402

RTOL = 1e-5


def first_difference(now: dict, golden: dict) -> str:
  for key in ("loss", "grad_norm"):
    differ = [i for i, (a, b) in enumerate(zip(now[key], golden[key])) if a != b]
    if differ:
      i = differ[0]
      return f"{key} from step {i} (now {float.fromhex(now[key][i])!r}, golden {float.fromhex(golden[key][i])!r})"
  return ""


def largest_relative_difference(now: dict, golden: dict) -> float:
  return max(
    abs(float.fromhex(a) / float.fromhex(b) - 1) for key in ("loss", "grad_norm") for a, b in zip(now[key], golden[key])
  )


@pytest.mark.parametrize("case", ["tiny_1dev", "tiny_8dev"])
def test_losses_equal_the_golden_file_bit_for_bit(case):
  files = golden_losses.golden_files(case)
  assert files, f"no golden file for {case}: python scripts/golden_losses.py {case} --write"
  done = subprocess.run([sys.executable, str(SCRIPT), case], capture_output=True, text=True, cwd=REPO, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  now = json.loads(done.stdout)
  goldens = {f.name: json.loads(f.read_text()) for f in files}
  for name, golden in goldens.items():
    assert now["overrides"] == golden["overrides"] and now["xla_flags"] == golden["xla_flags"], name
    assert len(now["loss"]) == len(golden["loss"]) == 30, name
  if any(not first_difference(now, golden) for golden in goldens.values()):
    return  # bit for bit equal to one CPU's file
  regenerate = f"a deliberate change regenerates them (scripts/golden_losses.py {case} --write) in a commit of its own"
  own = {name: g for name, g in goldens.items() if g.get("cpu") == now["cpu"]}
  for name, golden in own.items():
    pytest.fail(f"{case}: {first_difference(now, golden)} differs from {name}, written on this CPU; {regenerate}")
  # a CPU without a file of its own: the other CPUs' values up to last-bit rounding
  for name, golden in goldens.items():
    worst = largest_relative_difference(now, golden)
    assert worst < RTOL, (
      f"{case}: {first_difference(now, golden)} differs from {name} by {worst:.2e} relative, more than the "
      f"{RTOL:g} that rounding on another CPU ({now['cpu']}) explains; {regenerate}"
    )
