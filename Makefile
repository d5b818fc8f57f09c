# Two commands on a fresh machine: `make demo` and `make test`.
# TORCH_SPEC picks the torch build; the default is the CPU wheel. GPU users:
#   make demo TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test lint install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# Until the trained demo pair lands: a random tiny checkpoint, end to end through the CLI.
demo: install
	$(BIN)/redline init-random --out .demo/random-tiny
	$(BIN)/redline generate --model .demo/random-tiny --prompt "def main():" --max-tokens 64 --ignore-eos

test: install
	$(BIN)/ruff check redline tests benchmarks
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check redline tests benchmarks
	$(BIN)/ruff format --check redline tests benchmarks
