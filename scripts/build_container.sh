#!/usr/bin/env bash
# Builds the training container (Dockerfile) with docker or podman, and optionally turns it into an
# enroot squashfs image for SLURM clusters with pyxis (srun --container-image=FILE.sqsh):
#
#   scripts/build_container.sh [--base IMAGE] [--tag TAG] [--engine docker|podman] [--squashfs FILE.sqsh] [--dry-run]
#
#   --base      the JAX MaxText base image (default: the Dockerfile's, ghcr.io/nvidia/jax:maxtext-2026-09-09)
#   --tag       the image to build (default maxtext-moe-gpu:latest)
#   --engine    docker or podman (default: whichever is installed, docker first)
#   --squashfs  also `enroot import` the built image into FILE.sqsh (needs enroot)
#   --dry-run   print the commands instead of running them
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
BASE="" TAG="maxtext-moe-gpu:latest" ENGINE="" SQSH="" DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --base) BASE="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --engine) ENGINE="$2"; shift 2 ;;
    --squashfs) SQSH="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."

if [[ -z "$ENGINE" ]]; then
  if command -v docker >/dev/null 2>&1; then ENGINE=docker
  elif command -v podman >/dev/null 2>&1; then ENGINE=podman
  elif (( DRY )); then ENGINE=docker
  else echo "error: neither docker nor podman is installed; install one, or pass --engine" >&2; exit 2
  fi
fi
if [[ "$ENGINE" != docker && "$ENGINE" != podman ]]; then
  echo "error: --engine must be docker or podman, got '$ENGINE'" >&2; exit 2
fi
if [[ -n "$SQSH" ]] && ! command -v enroot >/dev/null 2>&1 && (( ! DRY )); then
  echo "error: --squashfs needs enroot (https://github.com/NVIDIA/enroot); build without it and import on the cluster" >&2; exit 2
fi

run() { echo "+ $*"; if (( ! DRY )); then "$@"; fi; }

args=(build -t "$TAG")
[[ -n "$BASE" ]] && args+=(--build-arg "BASE_IMAGE=$BASE")
run "$ENGINE" "${args[@]}" .
run "$ENGINE" run --rm "$TAG" python3 -c "import jax, MaxText.train; print('jax', jax.__version__, 'MaxText from', MaxText.__file__)"

if [[ -n "$SQSH" ]]; then
  # enroot reads the image straight from the local docker daemon or podman store.
  scheme=$([[ "$ENGINE" == docker ]] && echo dockerd || echo podman)
  run enroot import -o "$SQSH" "$scheme://$TAG"
  echo "SLURM: sbatch scripts/slurm/deepseek_v3_671b.sbatch with CONTAINER_IMAGE=$(realpath -m "$SQSH")"
fi
