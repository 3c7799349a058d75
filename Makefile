# The two commands the README leads with: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	touch $@

# Builds into ~/.cache/lora-gateway/demo (demo.DEMO_DIR), where `serve --demo` looks.
demo: install
	$(VENV)/bin/loragw demo
	$(VENV)/bin/loragw serve --demo --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
