# The training container: this project on top of the NGC-style JAX MaxText image, whose jax, jaxlib,
# CUDA plugin, Transformer Engine, cuDNN and NCCL are kept exactly as the image has them.
#
#   scripts/build_container.sh                      # docker or podman; --squashfs for SLURM (enroot/pyxis)
#   docker build --build-arg BASE_IMAGE=ghcr.io/nvidia/jax:maxtext-2026-09-09 -t maxtext-moe-gpu .
#
# tests/test_container.py checks this file against the project (what is copied, installed and run).
ARG BASE_IMAGE=ghcr.io/nvidia/jax:maxtext-2026-09-09
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/maxtext-moe-gpu

# Our runtime requirements, installed under a constraints file that pins every distribution the image
# already has to its installed version: pip adds only what is missing, and a requirement that would
# need another jax (or numpy, TE, ...) fails the build naming the conflict instead of replacing it.
COPY requirements.txt ./
RUN python3 -m pip list --format=freeze | grep -E '^[A-Za-z0-9_.-]+==' > /opt/image-pins.txt \
 && python3 -m pip install --no-cache-dir -c /opt/image-pins.txt -r requirements.txt \
 && python3 -m pip check

# The project itself, without dependencies (they are above). The image may hold upstream MaxText
# under the same package name: PYTHONPATH puts ours first, and the build checks which one imports.
COPY pyproject.toml README.md ./
COPY MaxText ./MaxText
COPY configs ./configs
COPY recipes ./recipes
COPY scripts ./scripts
COPY benchmarks ./benchmarks
COPY tests ./tests
COPY docs ./docs
RUN python3 -m pip install --no-cache-dir --no-deps -e . \
 && PYTHONPATH=/opt/maxtext-moe-gpu python3 -c "import MaxText, MaxText.train, MaxText.aot; assert MaxText.__file__.startswith('/opt/maxtext-moe-gpu/'), MaxText.__file__"

ENV PYTHONPATH=/opt/maxtext-moe-gpu \
    PYTHONUNBUFFERED=1 \
    MAXTEXT_IMAGE_PINS=/opt/image-pins.txt

# No GPU at build time: `docker run --gpus all IMAGE` prints what is usable (doctor) by default.
CMD ["python3", "-m", "MaxText.doctor"]
