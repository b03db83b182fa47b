# syntax=docker/dockerfile:1
# The kvbridge image, built from this checkout with the README's set-up (scripts/setup.sh).
#   docker build -t kvbridge:cpu .                           CPU build of PyTorch (default)
#   docker build --build-arg VARIANT=cuda -t kvbridge:cuda .  CUDA build of PyTorch
# ENTRYPOINT is the venv's `kvbridge`: `docker run kvbridge:cpu demo`, or the roles of deploy/k8s/.
ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim
ARG CUDA_BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM ${CPU_BASE} AS base-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

FROM ${CUDA_BASE} AS base-cuda
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

FROM base-${VARIANT} AS build
ARG VARIANT
WORKDIR /app
COPY . /app
# setup.sh picks PyTorch's CPU build where no GPU is visible, as during `docker build`; the cuda
# variant installs PyPI's default (CUDA) build first, which setup.sh then keeps.
RUN if [ "$VARIANT" = cuda ]; then \
        python3 -m venv .venv && .venv/bin/python -m pip install "torch>=2.4"; \
    fi \
 && bash scripts/setup.sh \
 && .venv/bin/kvbridge --help >/dev/null

FROM base-${VARIANT} AS runtime
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp kvbridge
WORKDIR /app
COPY --from=build /app /app
ENV PATH=/app/.venv/bin:$PATH \
    KVBRIDGE_CACHE=/cache \
    HOME=/tmp \
    PYTHONUNBUFFERED=1
RUN mkdir -p /cache && chown kvbridge:kvbridge /cache
USER 10001:10001
EXPOSE 50050 50051 8000 9400
ENTRYPOINT ["/app/.venv/bin/kvbridge"]
CMD ["--help"]
