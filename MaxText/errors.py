"""User-facing errors: one clear line, exit code 2, nothing written.

Every check of user input (config files, CLI overrides, mesh shapes) raises
`UserError`; the entry points catch it, print `error: <message>` to stderr and
exit with status 2 before anything is written to the run directory.
"""

import sys
from collections.abc import Callable


class UserError(Exception):
  """Bad input from the user; the message says what is wrong and how to fix it."""


EXIT_USER_ERROR = 2


def first_line(e: BaseException) -> str:
  """An exception as one line, its type and the first line of its message (a report's detail, not a traceback)."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def exit_on_user_error(main: Callable[[list[str]], int]) -> Callable[[list[str] | None], int]:
  """Wraps a CLI `main(argv)` so that a UserError becomes one stderr line and exit code 2."""

  def wrapped(argv: list[str] | None = None) -> int:
    try:
      return main(sys.argv[1:] if argv is None else argv)
    except UserError as e:
      print(f"error: {e}", file=sys.stderr)
      return EXIT_USER_ERROR

  return wrapped
