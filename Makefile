# make train: create .venv (Python >= 3.12) on first use, install, train the tiny DeepSeek-V3 recipe on CPU.
# make test:  the test suite (what .ci/run calls, after make lint).
# make lint:  ruff check and ruff format --check (line length 120).
PYTHON ?= $(shell scripts/find_python.sh)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install train test lint doctor clean

$(STAMP): requirements.txt requirements-dev.txt constraints.txt requirements-gpu-aot.txt pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: set PYTHON to a Python >= 3.12" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	# the CUDA plugin, kept apart: only the compile-only GPU checks put it on their path
	$(PY) -m pip install -q --no-deps --target $(VENV)/gpu-aot -r requirements-gpu-aot.txt
	touch $(STAMP)

# Python 3.11 + CPU torch + transformers: the reference the HF-parity tests compare against (test-only)
HF_STAMP := .venv-hf/.installed
$(HF_STAMP): requirements-hf-reference.txt scripts/hf_reference_venv.sh
	scripts/hf_reference_venv.sh >/dev/null

install: $(STAMP)

train: $(STAMP)
	$(PY) -m MaxText.train recipes/deepseek_v3_tiny.yml $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) $(HF_STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8 $${XLA_FLAGS:-}" $(PY) -m pytest -q tests

doctor: $(STAMP)
	$(PY) -m MaxText.doctor

clean:
	rm -rf $(VENV) .venv-hf runs .pytest_cache
