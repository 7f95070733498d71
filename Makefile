# Two commands from a fresh clone: `make quickstart` (the main job) and `make test`. Each installs what it needs
# into .venv first. On the CPU path torch 2.13.0 (CPU build) is installed before the package, so pip never pulls a
# multi-GB CUDA build; GPU users install into their own environment with `pip install -e .` and keep their torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.trl-aspo-installed

.PHONY: install quickstart quickstart-async smoke test lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/trl-aspo train --config configs/quickstart.yaml

quickstart-async: $(STAMP)
	$(BIN)/trl-aspo train --config configs/quickstart_async.yaml

smoke: $(STAMP)
	$(BIN)/trl-aspo train --config configs/smoke.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff format --check . && $(BIN)/ruff check .

# Wheels for scripts/gpu_check.py on the GPU machine (Python 3.12, no network): into build/gpu_wheels.
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python scripts/build_gpu_wheels.sh
