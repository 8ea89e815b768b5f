# The README's two commands: `make train` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned: a bare `torch` requirement would pull a multi-GB CUDA build; this CPU build
# installs from local disk on the project's machines.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv train test test-fast bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,plots,progress,logging]"
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/dropless train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/dropless bench layer --shape small --routing balanced
	$(BIN)/dropless bench layer --shape medium --routing balanced

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
