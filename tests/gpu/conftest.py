"""The GPU path, each test parametrized by case: "cuda" cases are marked `gpu` and skip where CUDA
is absent (the reason: "no CUDA device"); "cpu" cases run the same code on CPU where the code allows
it, so that it is exercised on every machine. A CUDA case on tiny-random or on no model at all is
also marked `quick`. scripts/gpu_check.sh runs `pytest tests/gpu -m gpu` on a GPU machine,
`-m "gpu and quick"` with --quick (no default model there), and `-m "not gpu"` with --cpu."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it (scripts/gpu_check.sh runs -m gpu)")
    config.addinivalue_line("markers", "quick: a gpu case on tiny-random or no model (gpu_check.sh --quick runs it)")


def on_cuda(value: str, gpus: int = 1, why: str = "", quick: bool = True):
    """A parameter that needs `gpus` CUDA devices: marked gpu, skipped (saying why) where fewer are
    visible; marked quick unless `quick` is False (a case on the default model)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reason = NO_CUDA if not visible else f"needs {gpus} CUDA devices ({why}); {visible} visible"
    marks = [pytest.mark.gpu, pytest.mark.skipif(visible < gpus, reason=reason)]
    return pytest.param(value, marks=[*marks, pytest.mark.quick] if quick else marks)


CASES = [on_cuda("cuda", quick=False), on_cuda("cuda-tiny"), "cpu"]


@pytest.fixture(scope="module", params=CASES)
def case(request) -> str:
    """What the module's engine runs on: "cuda" (the default model, bf16), "cuda-tiny" (tiny-random,
    bf16: the --quick case) or "cpu" (the module's choice of model: the code path, on every machine)."""
    return request.param
