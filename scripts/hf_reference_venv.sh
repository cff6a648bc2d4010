#!/usr/bin/env bash
# Prints the Python of the venv that runs the transformers reference (tests/hf_reference/), creating it on
# first use: Python 3.11 + requirements-hf-reference.txt (CPU torch, transformers) in .venv-hf.
#   HF_REFERENCE_PYTHON=/path/to/python3.11   the interpreter to build it from (default: found below)
#   HF_REFERENCE_VENV=DIR                     where the venv lives (default: .venv-hf at the repository root)
# Fails with one `error:` line and exit code 2 when no Python 3.11 is found or the install fails.
set -u
cd "$(dirname "$0")/.." || exit 2
venv=${HF_REFERENCE_VENV:-.venv-hf}
req=requirements-hf-reference.txt
stamp="$venv/.installed"
# Keep the venv out of git whatever the repository's .gitignore says (as Python >= 3.13's venv does itself).
ignore_venv() { [ -d "$venv" ] && [ ! -f "$venv/.gitignore" ] && echo "*" > "$venv/.gitignore"; return 0; }
ignore_venv
if [ -f "$stamp" ] && [ "$stamp" -nt "$req" ] && "$venv/bin/python" -c "" 2>/dev/null; then
  echo "$(cd "$venv" && pwd)/bin/python"; exit 0
fi

is_311() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; }
python=""
for candidate in "${HF_REFERENCE_PYTHON:-}" python3.11; do
  [ -n "$candidate" ] || continue
  path=$(command -v "$candidate" 2>/dev/null) || continue
  if is_311 "$path"; then python=$path; break; fi
done
if [ -z "$python" ]; then
  # pyenv keeps versions that are installed but not on PATH.
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for path in $(ls -d "$root"/versions/3.11*/bin/python3 2>/dev/null | sort -V -r); do
    if is_311 "$path"; then python=$path; break; fi
  done
fi
if [ -z "$python" ]; then
  echo "error: no Python 3.11 found for the transformers reference (CPU torch 2.13.0 is built for it); set HF_REFERENCE_PYTHON" >&2
  exit 2
fi

log=$(mktemp)
fail() { echo "error: $1 failed: $(grep -i error "$log" | tail -1)" >&2; rm -f "$log"; exit 2; }
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >"$log" 2>&1 || fail "creating $venv with $python"
ignore_venv
"$venv/bin/python" -m pip install -q -r "$req" >"$log" 2>&1 || fail "installing $req into $venv"
rm -f "$log"
touch "$stamp"
echo "$(cd "$venv" && pwd)/bin/python"
