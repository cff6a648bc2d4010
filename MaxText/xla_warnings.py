"""XLA's partitioner warnings of one compile, captured and counted.

"Involuntary full rematerialization" is XLA's SPMD partitioner saying it could not move a tensor from one
sharding to another with collectives, so it replicated the whole tensor on every device and sliced it again.
At scale that is a sharding bug: memory for the whole tensor and bandwidth to build it, every step. XLA
prints it from C++ on file descriptor 2, so it is captured there (Python's sys.stderr would miss it).
"""

import contextlib
import os
import re
import sys
import tempfile

INVOLUNTARY = "Involuntary full rematerialization"
_OPERATION = re.compile(r"for HLO operation (%?[\w.\-]+ = \S+)")


class Captured:
  """What native code wrote to stderr inside `capture_stderr()`: its text, once the block has ended."""

  text = ""

  def involuntary_rematerializations(self) -> list[str]:
    """One entry per warning: the HLO operation XLA replicated ('%gather = f32[16,64,64]{2,1,0}', ...)."""
    found = []
    for line in self.text.splitlines():
      if INVOLUNTARY in line:
        op = _OPERATION.search(line)
        found.append(op.group(1) if op else line.strip()[:200])
    return found


@contextlib.contextmanager
def capture_stderr():
  """Redirects file descriptor 2 to a temporary file while the block runs, then writes what was captured to
  the real stderr (nothing is hidden, only delayed to the block's end) and keeps it in the yielded Captured."""
  captured = Captured()
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield captured
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      captured.text = tmp.read().decode(errors="replace")
      if captured.text:
        sys.stderr.write(captured.text)
        sys.stderr.flush()


def describe(ops: list[str], most: int = 3) -> str:
  """One line for the report: how many, and the distinct operations (at most `most`)."""
  if not ops:
    return "XLA partitioner: no involuntary full rematerialization"
  distinct = list(dict.fromkeys(ops))
  shown = "; ".join(distinct[:most]) + (f"; and {len(distinct) - most} more" if len(distinct) > most else "")
  return (
    f"XLA partitioner: {len(ops)} involuntary full rematerialization(s) (a sharding conflict XLA resolved by "
    f"replicating the whole tensor on every device: memory and bandwidth at scale): {shown}"
  )
