# Set-up and everyday commands. `make run` and `make test` work on a fresh machine: they
# create .venv, install PyTorch (the CPU build where no NVIDIA GPU is present, so that no
# multi-GB CUDA build is pulled), then this package, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch>=2.6
else
TORCH_SPEC ?= torch==2.13.0
# PyTorch's CPU index, unless this machine's pip is set up with its own wheels
# (/etc/xdg/pip); scripts/install_torch.sh falls back to PyPI where the index does not answer.
USE_CPU_INDEX ?= $(if $(wildcard /etc/xdg/pip),0,1)
endif

.PHONY: install run test test-newest test-quick test-axolotl lint format clean

$(BIN)/protrain: pyproject.toml constraints.txt scripts/install_torch.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	TORCH_SPEC="$(TORCH_SPEC)" USE_CPU_INDEX="$(USE_CPU_INDEX)" scripts/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(BIN)/protrain

install: $(BIN)/protrain

run: install
	$(BIN)/protrain train

# Then the exactness tests again under each narrower CPU vector width torch has kernels for
# (their reductions sum in another order): on AVX-512, under avx2 and default.
test: install
	$(BIN)/python -m pytest -q
	for cap in $$($(BIN)/python scripts/lower_cpu_capabilities.py); do \
		echo "exactness tests under ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -q -m exactness || exit 1; \
	done

# The suite against the newest releases pyproject.toml allows (no constraints.txt), in a venv
# of its own: run it before raising the pins.
NEWEST ?= .venv-newest
test-newest:
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	TORCH_SPEC="$(TORCH_SPEC)" USE_CPU_INDEX="$(USE_CPU_INDEX)" scripts/install_torch.sh $(NEWEST)/bin/python
	$(NEWEST)/bin/python -c "import torch; print('torch==' + torch.__version__)" > $(NEWEST)/torch.txt
	$(NEWEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager \
		-c $(NEWEST)/torch.txt -e ".[dev]"  # torch stays the build TORCH_SPEC chose
	$(NEWEST)/bin/python -m pip list --format=freeze | grep -iE "^(torch|transformers|peft|trl|accelerate|datasets|tokenizers|safetensors|pydantic|bitsandbytes)=="
	$(NEWEST)/bin/python -m pytest -q

# ProTrainPlugin under the real axolotl (the release docs name) in a venv of its own, on the
# CPU: the example and axolotl's lora-1b.yml train a few steps. Not part of `make test`.
test-axolotl:
	scripts/test_axolotl.sh

# The unit tests of data, config, block discovery and the planner's search: no training run.
QUICK_TESTS ?= tests/data tests/model tests/train/test_config.py tests/plan/test_search.py \
	tests/plan/test_runtime_model.py tests/plan/test_segments.py
test-quick: install
	$(BIN)/python -m pytest -q -m "not slow" $(QUICK_TESTS)

lint: install
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

format: install
	$(BIN)/ruff format src tests benchmarks scripts
	$(BIN)/ruff check --fix src tests benchmarks scripts

clean:
	rm -rf $(VENV) $(NEWEST) .venv-axolotl outputs .pytest_cache
