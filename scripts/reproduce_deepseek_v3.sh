#!/usr/bin/env bash
# The DeepSeek-V3 procedure, end to end (docs/deepseek_v3_671b.md):
#
#   1. environment   python -m MaxText.doctor: GPU, driver, jax/TE, NCCL, usable MoE backends
#   2. container     SLURM only: build it and import it as an enroot squashfs (or use CONTAINER_IMAGE)
#   3. plan          python -m MaxText.aot: compile the step for the cluster on this machine's CPU;
#                    stop here if it does not fit (exit 3)
#   4. launch        sbatch scripts/slurm/deepseek_v3_671b.sbatch (SLURM), or train on this host (local)
#   5. results       where the metrics appear and what to compare them with
#
#   scripts/reproduce_deepseek_v3.sh [options] [-- key=value ...]
#
#   --recipe R       default recipes/deepseek_v3_671b/optimized.yml; the 1-GPU proxy:
#                    --recipe recipes/deepseek_v3_proxy_1gpu/optimized.yml --num-gpus 1 --launcher local
#   --gpu G          h200 (default) or h100, for the plan
#   --num-gpus N     GPUs of the cluster (default 128 = 16 nodes x 8)
#   --launcher L     slurm (default) or local (this host's GPUs, one process per host)
#   --run-name NAME  run directory name (default dsv3-<recipe>-<date>)
#   --out DIR        where the plan and (local) run directories go (default runs)
#   --dry-run        do everything short of training: doctor, plan, and print the build/launch commands
#   key=value ...    overrides for both the plan and the run (e.g. steps=50)
set -euo pipefail

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; }
RECIPE=recipes/deepseek_v3_671b/optimized.yml GPU=h200 NUM_GPUS=128 LAUNCHER=slurm RUN_NAME="" OUT=runs DRY=0
OVERRIDES=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --recipe) RECIPE="$2"; shift 2 ;;
    --gpu) GPU="$2"; shift 2 ;;
    --num-gpus) NUM_GPUS="$2"; shift 2 ;;
    --launcher) LAUNCHER="$2"; shift 2 ;;
    --run-name) RUN_NAME="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    *=*) OVERRIDES+=("$1"); shift ;;
    *) echo "error: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
[[ -f "$RECIPE" ]] || { echo "error: recipe $RECIPE does not exist" >&2; exit 2; }
[[ "$LAUNCHER" == slurm || "$LAUNCHER" == local ]] || { echo "error: --launcher must be slurm or local, got '$LAUNCHER'" >&2; exit 2; }
[[ "$NUM_GPUS" =~ ^[1-9][0-9]*$ ]] || { echo "error: --num-gpus must be a positive number, got '$NUM_GPUS'" >&2; exit 2; }
RUN_NAME="${RUN_NAME:-dsv3-$(basename "$(dirname "$RECIPE")")-$(basename "$RECIPE" .yml)-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # absolute: the container and SLURM see the same paths
step() { echo; echo "== $*"; }
show() { echo "+ $*"; }

step "1. environment (python -m MaxText.doctor)"
# Missing optional pieces are expected on a login or CPU node; the GPU nodes are checked at launch.
JAX_PLATFORMS="${JAX_PLATFORMS:-}" "$PYTHON" -m MaxText.doctor || echo "(doctor: required pieces missing here; fix them before training on this machine)"

step "2. container"
if [[ "$LAUNCHER" == slurm ]]; then
  if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    echo "using CONTAINER_IMAGE=$CONTAINER_IMAGE"
  else
    CONTAINER_IMAGE="$OUT/maxtext-moe-gpu.sqsh"
    build=(scripts/build_container.sh --squashfs "$CONTAINER_IMAGE")
    if (( DRY )); then scripts/build_container.sh --dry-run --squashfs "$CONTAINER_IMAGE"; else "${build[@]}"; fi
  fi
else
  echo "local launch: this host's environment (or run this script inside the container: docker run --gpus all ...)"
fi

step "3. plan: $RECIPE on $NUM_GPUS x $GPU (python -m MaxText.aot)"
PLAN="$OUT/$RUN_NAME.plan.json"
plan=("$PYTHON" -m MaxText.aot "$RECIPE" --gpu "$GPU" --num-gpus "$NUM_GPUS" --json "$PLAN" "${OVERRIDES[@]}")
show "${plan[@]}"
set +e
"${plan[@]}"
rc=$?
set -e
if (( rc == 3 )); then
  echo "stopped: the plan does not fit $NUM_GPUS x $GPU (above); nothing launched" >&2; exit 3
elif (( rc != 0 )); then
  exit "$rc"
fi
echo "plan written to $PLAN"

step "4. launch"
if [[ "$LAUNCHER" == slurm ]]; then
  NODES=$(( (NUM_GPUS + 7) / 8 ))
  launch=(env RECIPE="$RECIPE" CONTAINER_IMAGE="$CONTAINER_IMAGE" OUTPUT_DIR="$OUT" RUN_NAME="$RUN_NAME"
          sbatch --nodes="$NODES" scripts/slurm/deepseek_v3_671b.sbatch "${OVERRIDES[@]}")
else
  launch=("$PYTHON" -m MaxText.train "$RECIPE" base_output_directory="$OUT" run_name="$RUN_NAME" "${OVERRIDES[@]}")
fi
show "${launch[@]}"
if (( DRY )); then
  echo "(dry run: not launched)"
else
  "${launch[@]}"
fi

step "5. results"
cat <<MSG
run directory: $OUT/$RUN_NAME/
  metrics.jsonl   one JSON line per logged step: loss, step_time_s, tokens_per_s_per_device, tflops_per_device, mfu, ...
  summary.json    medians after warm-up, peak memory, compile time
  tensorboard/    tensorboard --logdir $OUT/$RUN_NAME/tensorboard
  checkpoints/    every checkpoint_period steps and on SIGTERM; the same command resumes
expect: step time above the plan's lower bound ($PLAN: lower_bound_step_s); the measured 1-GPU proxy
numbers (tokens/s and model TFLOP/s per GPU, baseline vs optimized) are in docs/performance.md.
MSG
