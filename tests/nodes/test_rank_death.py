"""`kill -9` of one rank: the node fails its streams, exits non-zero within seconds (so that a
supervisor restarts it), and leaves no shared memory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.kv_transfer.backends.shm import NAME_PREFIX, SHM_DIR, remove_stale_segments
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.test_load import Process, process_tree
from tests.pd import pd_generate, token_prompt

NODE = ("--model", "tiny-random", "--port", "0", "--pp-size", "2", "--log-level", "warning")
EXIT_WITHIN_S = 5.0


def ranks_of(proc: Process) -> list[int]:
    tree = process_tree({"node": proc.proc.pid})
    return [pid for label, pid in sorted(tree.items()) if label.startswith("node/rank")]


def segments_of(pids: list[int]) -> list[str]:
    return sorted(p.name for pid in pids for p in SHM_DIR.glob(f"{NAME_PREFIX}{pid}-*"))


def test_a_killed_rank_fails_the_streams_and_the_node_exits_non_zero():
    node = Process("colocated", "serve", *NODE)
    try:
        node.wait_ready()
        sampling = common_pb2.SamplingParams(max_new_tokens=4000, ignore_eos=True)
        req = generation_pb2.GenerateRequest(prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[1, 2])))
        req.sampling.CopyFrom(sampling)
        stream = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address)).Generate(req, timeout=60)
        assert next(stream).token_ids  # decoding
        rank1 = ranks_of(node)[1]
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "pipeline rank 1 of the colocated node died" in e.value.details()
        assert node.proc.wait(timeout=30) == 1 and time.monotonic() - killed < EXIT_WITHIN_S
        assert any("error: pipeline rank 1 died" in line for line in node.lines)
    finally:
        node.stop()


def test_a_decode_node_that_lost_a_rank_exits_and_leaves_no_segment():
    node = Process("decode", "decode", *NODE, "--transfer-backend", "shm")
    try:
        node.wait_ready()
        ranks = ranks_of(node)
        assert len(segments_of(ranks)) == 2  # each rank's pool, in /dev/shm
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        assert node.proc.wait(timeout=30) == 1 and time.monotonic() - killed < EXIT_WITHIN_S
        assert segments_of(ranks) == []
    finally:
        node.stop()


def test_a_starting_node_removes_segments_of_dead_processes():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = SHM_DIR / f"{NAME_PREFIX}{int(gone.stdout)}-r0-0123abcd", SHM_DIR / f"{NAME_PREFIX}{os.getpid()}-r0-x"
    try:
        dead.write_bytes(b"\0" * 4096)  # what a rank killed with -9 leaves (its pid is gone)
        alive.write_bytes(b"\0" * 4096)  # a live process's: kept
        assert dead.name in remove_stale_segments()
        assert not dead.exists() and alive.exists()
    finally:
        dead.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)


def test_a_rank_whose_consensus_channel_fails_ends_the_node_like_a_dead_rank():
    """Rank 1's control thread fails (injected, at the first round after the request's route):
    the rank ends, the request fails with the rank named, and the prefill node exits non-zero."""
    prefill = Process("prefill", "prefill", *NODE, "--fault-inject", "rank1:consensus_fail_after=1")
    decode = Process("decode", "decode", *NODE)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        started = time.monotonic()
        try:  # (the decode half may finish first, with the pages it got: then the prefill half raises)
            result = pd_generate(prefill.address, decode.address, token_prompt([1, 2, 3]), 4, timeout=60)[2]
        except grpc.RpcError as e:
            result = e
        assert isinstance(result, grpc.RpcError) and result.code() == grpc.StatusCode.UNAVAILABLE, result
        # whichever half saw it first: the prefill node failing its streams, or the decode node its peer going away
        assert result.details() in (
            "pipeline rank 1 of the prefill node died",
            f"the prefill node {prefill.address} is unreachable",
        )
        assert prefill.proc.wait(timeout=30) == 1 and time.monotonic() - started < EXIT_WITHIN_S
        failed = "the consensus channel failed: RuntimeError('injected consensus failure after 1 status changes')"
        assert any(failed in line for line in prefill.lines), prefill.lines[-5:]
    finally:
        prefill.stop()
        decode.stop()
