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

IMAGE ?= ghcr.io/lora-gateway/lora-gateway
TAG ?= $(shell sed -n 's/^appVersion: "\(.*\)"/\1/p' helm/Chart.yaml)
VARIANT ?= cuda
# What `make test` needs beyond Python, as command:package pairs: redis-server for the fleet
# tests, a C compiler for the CPU kernels (kernels/native.py), buildah and debootstrap to build
# the image without a registry (tests/test_image.py).
SYSTEM_TOOLS := redis-server:redis-server cc:gcc buildah:buildah debootstrap:debootstrap

.PHONY: install system-deps quant-tools quant-world demo test lint bench image clean

install: $(VENV)/.installed

# apt-get where there is one (as root, or through sudo); elsewhere a message naming the packages.
system-deps:
	@missing=""; \
	for pair in $(SYSTEM_TOOLS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; \
	done; \
	[ -z "$$missing" ] && exit 0; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "make test needs:$$missing. Install them with your system's package manager" \
	       "(macOS: brew install redis; a C compiler comes with the Xcode tools)." >&2; exit 1; \
	fi; \
	sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	echo "installing$$missing with apt-get"; \
	$$sudo apt-get update -qq && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null

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
	$(PY) -P -c "import sys; sys.path.insert(0, 'tests'); from quant_checkpoints import build_world; build_world('.quant-world/llama', 'llama')"

# Builds into ~/.cache/lora-gateway/demo (demo.DEMO_DIR), where `serve --demo` looks.
demo: install
	$(VENV)/bin/loragw demo
	$(VENV)/bin/loragw serve --demo --host $(HOST) --port $(PORT)

# pytest's own script, not `python -m pytest`: the checkout's root stays off sys.path.
test: system-deps install quant-tools
	$(VENV)/bin/pytest -q tests

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/bench_engine.py

# The image the Helm chart pulls: VARIANT=cuda (default) or cpu, with whichever of docker,
# podman or buildah is here (in Docker's format: OCI's has no HEALTHCHECK). IMAGE and TAG
# default to the chart's image.repository and tag.
image:
	@tool=$$(for t in docker podman buildah; do command -v $$t >/dev/null 2>&1 && echo $$t && break; done); \
	[ -n "$$tool" ] || { echo "make image needs docker, podman or buildah" >&2; exit 1; }; \
	case $$tool in docker) build="docker build";; *) build="$$tool build --format docker";; esac; \
	echo "$$build -t $(IMAGE):$(TAG)$(if $(filter cpu,$(VARIANT)),-cpu) --build-arg VARIANT=$(VARIANT) ."; \
	$$build -t $(IMAGE):$(TAG)$(if $(filter cpu,$(VARIANT)),-cpu) --build-arg VARIANT=$(VARIANT) $(IMAGE_ARGS) .

clean:
	rm -rf $(VENV) $(QVENV) .pytest_cache build *.egg-info
