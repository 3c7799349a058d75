# The two commands the README leads with: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# llm-compressor pins its own transformers: the tests' quantized checkpoints and their
# decompressed reference are made in a venv of its own (tests/quant_reference/).
QVENV ?= .venv-quant
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install quant-tools quant-world demo test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	touch $@

quant-tools: $(QVENV)/.installed

$(QVENV)/.installed:
	test -x $(QVENV)/bin/python || $(PYTHON) -m venv $(QVENV)
	$(QVENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(QVENV)/bin/pip install --quiet "llmcompressor==0.14.0.1" "auto-round==0.15.1" peft
	touch $@

# The quantized checkpoints and their oracle, for a GPU machine that cannot install
# llm-compressor (benchmarks/gpu_session.sh reads .quant-world/llama).
quant-world: install quant-tools
	$(PY) -c "import sys; sys.path.insert(0, 'tests'); from quant_checkpoints import build_world; build_world('.quant-world/llama', 'llama')"

# Builds into ~/.cache/lora-gateway/demo (demo.DEMO_DIR), where `serve --demo` looks.
demo: install
	$(VENV)/bin/loragw demo
	$(VENV)/bin/loragw serve --demo --host $(HOST) --port $(PORT)

test: install quant-tools
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) $(QVENV) .pytest_cache build *.egg-info
