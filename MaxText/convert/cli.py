"""What the conversion and scoring CLIs share: argument errors as one line, all-or-nothing outputs.

Bad arguments raise UserError (so `exit_on_user_error` prints one `error:` line
and exits 2, where argparse would print usage and its own message). Outputs are
written into a temporary sibling and renamed into place at the end: a command
that fails or is interrupted leaves no OUT behind (at most a hidden
`.OUT.tmp-*` sibling if the process is killed outright), so an OUT that exists
is complete.
"""

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from MaxText.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
  def error(self, message):
    usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
    raise UserError(f"{message} (usage: {usage})")


def check_new(out: Path, flag: str) -> None:
  if out.exists():
    raise UserError(f"{flag} {out} already exists; remove it or choose another path")
  if not out.parent.is_dir():
    raise UserError(f"{flag} {out}: its parent directory {out.parent} does not exist")


def check_writable(out: Path, flag: str) -> None:
  """A file the command will write (replacing one that is there): its directory exists and it is not a directory."""
  if out.is_dir():
    raise UserError(f"{flag} {out} is a directory; name a file")
  if not out.parent.is_dir():
    raise UserError(f"{flag} {out}: its parent directory {out.parent} does not exist")


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


@contextlib.contextmanager
def staged_dir(out: Path, flag: str):
  """Yields an empty temporary directory beside `out`, renamed to `out` if the block completes."""
  check_new(out, flag)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
  try:
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; OUT gets the usual permissions
    yield tmp
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


@contextlib.contextmanager
def staged_file(out: Path, flag: str):
  """Yields a temporary file path beside `out`, which replaces `out` if the block completes."""
  if not out.parent.is_dir():
    raise UserError(f"{flag} {out}: its parent directory {out.parent} does not exist")
  fd, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
  os.close(fd)
  try:
    Path(name).chmod(0o666 & ~_umask())
    yield Path(name)
    os.replace(name, out)
  except BaseException:
    Path(name).unlink(missing_ok=True)
    raise
