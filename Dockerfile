# The image the Helm chart pulls: `loragw serve` on port 8000, as an unprivileged user.
#
#   make image                  VARIANT=cuda: torch's CUDA build (the GPU driver comes from the
#                               NVIDIA container runtime, as with any CUDA image)
#   make image VARIANT=cpu      torch's CPU build, tagged <version>-cpu
#
# BASE is any Debian-like image with python3 >= 3.11, its venv module and its headers
# (tests/test_image.py builds one with debootstrap, where no registry can be reached).
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VARIANT=cuda
ARG TORCH_SPEC=torch==2.13.0
# Where each variant's torch comes from ("" is pip's own index: PyPI's torch is the CUDA build).
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_CUDA=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN case "${VARIANT}" in cpu|cuda) ;; *) echo "VARIANT is cpu or cuda, not ${VARIANT}" >&2; exit 1 ;; esac \
    && python3 -m venv /opt/loragw \
    && index="$([ "${VARIANT}" = cpu ] && echo "${TORCH_INDEX_CPU}" || echo "${TORCH_INDEX_CUDA}")" \
    && /opt/loragw/bin/pip install --upgrade pip \
    && /opt/loragw/bin/pip install ${index:+--index-url "${index}"} "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY loragw/ loragw/
COPY engine/ engine/
COPY kernels/ kernels/
COPY adapters/ adapters/
COPY gateway/ gateway/
COPY demo/ demo/
# Not editable: the wheel's own files, so /src can go.
RUN /opt/loragw/bin/pip install . && /opt/loragw/bin/loragw --help >/dev/null

FROM ${BASE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VARIANT=cuda
# A C compiler at run time: the CPU kernels are built on first use for the CPU they run on,
# and Triton compiles its launchers on a GPU.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/loragw loragw
COPY --from=build /opt/loragw /opt/loragw
# LORAGW_HOST: every flag reads LORAGW_<FLAG>; a container listens on all its interfaces.
ENV PATH=/opt/loragw/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    LORAGW_HOST=0.0.0.0 \
    LORAGW_PORT=8000 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
LABEL org.opencontainers.image.title="lora-gateway" \
      org.opencontainers.image.description="One base model serving many LoRA adapters behind an OpenAI-compatible API" \
      org.opencontainers.image.source="https://github.com/lora-gateway/lora-gateway" \
      org.opencontainers.image.licenses="Apache-2.0" \
      ai.loragw.variant="${VARIANT}"
USER 1000:1000
WORKDIR /home/loragw
EXPOSE 8000
# /health is the liveness answer (the model need not be loaded yet); the start period covers a
# large model's load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('LORAGW_PORT', '8000')}/health\", timeout=4)"]
ENTRYPOINT ["loragw", "serve"]
# With no arguments: the demo model and adapters, built at start (a minute on a CPU).
CMD ["--demo"]
