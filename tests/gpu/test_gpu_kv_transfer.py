"""The GPU engines between two real processes, with tests/kv_transfer/test_kv_transfer_engines.py's
plan (two prefill ranks -> three decode ranks, rooms pushed chunk by chunk, an abort, every bad input
the engine carries) and its checks, byte for byte: cuda_ipc (device-to-device copies through IPC
handles), torch over NCCL (two GPUs: NCCL pairs no two ranks on one GPU), torch over gloo from a GPU
pool to a CPU one, and grpc between GPU pools. The CPU case (shm, the direct-write path cuda_ipc
shares) runs the same checks on every machine."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import on_cuda
from tests.kv_transfer.test_kv_transfer_engines import (  # noqa: F401 (the engine suite's checks, on `run` below)
    DIRECT_CASES,
    ENGINES,
    GRPC_CASES,
    TORCH_CASES,
    run_engine,
    test_an_abort_fails_exactly_the_decode_ranks_the_aborting_rank_feeds,
    test_bad_inputs_fail_their_room_with_a_clear_reason,
    test_decode_pools_hold_exactly_the_pushed_pages_and_zeros_elsewhere,
    test_first_tokens_reach_decode_rank_zero,
    test_good_rooms_succeed_on_every_rank_of_both_sides,
    test_pool_segments_are_owner_only_while_open_and_gone_after_close,
)

CASES = {  # test id -> (engine, decode device, prefill device, bad cases)
    "cuda_ipc": ENGINES["cuda_ipc"],
    "torch_nccl": ENGINES["torch_nccl"],
    "torch_gpu_to_cpu": ("torch", "cpu", "cuda:0", TORCH_CASES),
    "grpc_gpu": ("grpc", "cuda:0", "cuda:0", GRPC_CASES),
    "shm": ("shm", "cpu", "cpu", DIRECT_CASES),
}
PARAMS = [
    on_cuda("cuda_ipc"),
    on_cuda("torch_nccl", gpus=2, why="NCCL pairs no two ranks on one GPU"),
    on_cuda("torch_gpu_to_cpu"),
    on_cuda("grpc_gpu"),
    "shm",
]


@pytest.fixture(scope="module", params=PARAMS)
def run(request):
    engine, d_device, p_device, cases = CASES[request.param]
    return run_engine(engine, d_device, p_device, cases), cases, d_device
