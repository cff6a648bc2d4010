#!/usr/bin/env bash
# Starts N processes of `python -m MaxText.train` on this machine, as one multi-process JAX job:
#
#   scripts/launch_local.sh N RECIPE.yml [key=value ...]
#
# Each process gets JAX_COORDINATOR_ADDRESS=localhost:PORT, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i
# (MaxText/distributed.py reads them). With NVIDIA GPUs, process i owns an equal block of them
# (JAX_LOCAL_DEVICE_IDS); without, each process has its own host CPU devices (set their number with
# XLA_FLAGS=--xla_force_host_platform_device_count=K; CPU collectives go through gloo).
# Output lines are prefixed with [i]. If a process fails the others are stopped; the exit code is the
# first non-zero one. PYTHON (default .venv/bin/python if present, else python3) and PORT (default
# a free one) may be set.
set -euo pipefail

if [[ $# -lt 2 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  [[ $# -ge 1 && ("$1" == -h || "$1" == --help) ]] && exit 0 || exit 2
fi
N="$1"; shift
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: N must be a positive number of processes, got '$N'" >&2; exit 2
fi
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
PORT="${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}"

GPUS=0
if [[ "${JAX_PLATFORMS:-}" != cpu ]] && command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if (( GPUS > 0 && GPUS % N != 0 )); then
  echo "error: $GPUS GPUs cannot be split evenly over $N processes" >&2; exit 2
fi

pids=()
# Stops the processes this script started: each subshell's children (python, sed), then the subshell.
cleanup() { for p in "${pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM

for ((i = 0; i < N; i++)); do
  ids=""
  if (( GPUS > 0 )); then
    per=$((GPUS / N)); ids=$(seq -s, $((i * per)) $((i * per + per - 1)))
  fi
  (
    export JAX_COORDINATOR_ADDRESS="localhost:$PORT" JAX_NUM_PROCESSES="$N" JAX_PROCESS_ID="$i"
    [[ -n "$ids" ]] && export JAX_LOCAL_DEVICE_IDS="$ids"
    "$PYTHON" -u -m MaxText.train "$@" 2>&1 | sed -u "s/^/[$i] /"  # pipefail: the status is python's
  ) &
  pids+=($!)
done

status=0
for p in "${pids[@]}"; do
  if ! wait "$p"; then
    rc=$?
    if (( status == 0 )); then status=$rc; cleanup; fi
  fi
done
exit "$status"
