"""The GPU path, each test parametrized by device: "cuda" cases are marked `gpu` and skip where CUDA
is absent (the reason: "no CUDA device"); "cpu" cases run the same code on CPU where the code allows
it, so that it is exercised on every machine. scripts/gpu_check.sh runs `pytest tests/gpu -m gpu` on
a GPU machine (`-m "not gpu"` with --cpu)."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it (scripts/gpu_check.sh runs -m gpu)")


def on_cuda(value: str, gpus: int = 1, why: str = ""):
    """A parameter that needs `gpus` CUDA devices: marked gpu, skipped (saying why) where fewer are visible."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reason = NO_CUDA if not visible else f"needs {gpus} CUDA devices ({why}); {visible} visible"
    return pytest.param(value, marks=(pytest.mark.gpu, pytest.mark.skipif(visible < gpus, reason=reason)))


@pytest.fixture(scope="module", params=[on_cuda("cuda"), "cpu"])
def device(request) -> str:
    """Where the module's engine runs: "cuda" (bf16; skipped without CUDA) or "cpu"."""
    return request.param
