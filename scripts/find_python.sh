#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter (jax >= 0.11 needs it), or explains and fails.
set -u
for candidate in "${PYTHON:-}" python3.12 python3.13 python3.14 python3; do
  [ -n "$candidate" ] || continue
  path=$(command -v "$candidate" 2>/dev/null) || continue
  if "$path" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    echo "$path"; exit 0
  fi
done
# pyenv keeps versions that are installed but not on PATH.
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for path in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do
  if "$path" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    echo "$path"; exit 0
  fi
done
echo "error: no Python >= 3.12 found (jax >= 0.11 needs it); install one or run 'make PYTHON=/path/to/python3.12'" >&2
exit 2
