"""KV pages between real processes, for each engine.

A decode process hosts three decode ranks (layers [(0,2),(2,4),(4,6)] of a 6-layer model);
a prefill process hosts two prefill ranks ([(0,3),(3,6)]) with random pools. The prefill side
pushes two rooms' pages chunk by chunk (a partial last page pushed again with the next chunk),
sends first tokens, and finishes; a third room is aborted by prefill rank 1. Before that it
sends each bad input the engine can carry. The decode side reports states, reasons, first
tokens and how its pools differ from the expected pages (computed independently, page by page).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
import torch.multiprocessing as mp

from kvbridge.common.rpc import make_channel
from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer import (
    BACKENDS,
    KVReceiverEndpoint,
    NodeLayout,
    PageGeometry,
    RankInfo,
    ReceiverConfig,
    local_host_id,
    make_sender,
    overlap,
)
from kvbridge.kv_transfer.adapters import sources_of
from kvbridge.kv_transfer.backends.torch_p2p import DATA, Header, PairClient
from kvbridge.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

KEY = bytes(range(16))  # the rooms' write key (the decode node mints one per room)

TIMEOUT_S = 150
GEOMETRY = PageGeometry(page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
NUM_LAYERS, NUM_PAGES, PS = 6, 32, 4
P_RANGES = [(0, 3), (3, 6)]
D_RANGES = [(0, 2), (2, 4), (4, 6)]
BLOCK = GEOMETRY.layer_block_bytes  # 512 bytes: one layer of one page


@dataclass(frozen=True)
class RoomPlan:
    room: int  # pairing key
    prompt: int  # prompt tokens
    src: tuple[int, ...]  # prefill page ids, in prompt order
    dst: tuple[int, ...]  # decode page ids registered for it
    chunk: int  # tokens per prefill chunk


GOOD = (
    RoomPlan(0x1234_5678, 22, tuple(range(10, 16)), tuple(range(20, 26)), 7),  # consecutive ids: block runs
    RoomPlan(0xF000_0000_0000_0001, 13, (3, 17, 8, 30), (5, 1, 29, 12), 5),  # scattered ids; room >= 2**63
)
ABORTED = RoomPlan(0x77, 8, (0, 1), (2, 3), 4)  # prefill rank 0 aborts it; nobody pushes
PLANS = (*GOOD, ABORTED)
FIRST_TOKENS = {plan.room: (100 + i, plan.prompt) for i, plan in enumerate(GOOD)}
B1, B2, B3, B4, B5 = 0xB1, 0xB2, 0xB3, 0xB4, 0xB5  # bad rooms (B5 is never expected)
BAD_PAGES = (6, 7)  # registered for B1..B4 on every decode rank; must stay zero

W, F = "WAITING_FOR_INPUT", "FAILED"


@dataclass(frozen=True)
class BadCase:
    d_states: tuple[str, ...]  # each decode rank's state afterwards
    d_reason: str  # the reason on the ranks that failed
    p_result: str | None  # what the prefill side observed (None: nothing synchronous to observe)


def _data_path_cases(p_results: dict) -> dict:
    return {
        B1: BadCase((W, F, W), "page id 32 out of range [0, 32)", p_results.get(B1)),
        B2: BadCase((W, F, W), "page id 9 is not registered for room 178", p_results.get(B2)),
        B3: BadCase((W, F, W), "layers [3, 4) are outside prefill rank 0's overlap [2, 3) with decode rank 1", None),
        B4: BadCase((W, F, W), "100 bytes for 1 pages x 1 layers; expected 512", p_results.get(B4)),
        B5: BadCase((), "", "NOT_FOUND: room 181 is not expected on decode rank 1"),
    }


GRPC_CASES = _data_path_cases(
    {
        B1: "INVALID_ARGUMENT: page id 32 out of range [0, 32)",
        B2: "INVALID_ARGUMENT: page id 9 is not registered for room 178",
        B4: "INVALID_ARGUMENT: 100 bytes for 1 pages x 1 layers; expected 512",
    }
)
GRPC_CASES[B3] = dataclasses.replace(GRPC_CASES[B3], p_result="INVALID_ARGUMENT: " + GRPC_CASES[B3].d_reason)
TORCH_CASES = _data_path_cases({})
DIRECT_CASES = {  # shm, cuda_ipc: the prefill rank writes into the pool; its checks and the notices guard
    B1: BadCase(
        (W, F, F),
        "prefill rank 1: destination page id 32 out of range [0, 32)",
        "FAILED: destination page id 32 out of range [0, 32)",
    ),
    B2: BadCase((W, W, W), "", "ValueError: push of room 178: destination page 9 was not registered"),
    B3: BadCase(
        (W, F, W),
        "notice for layers [2, 4) from prefill rank 0; its overlap with decode rank 1 is [2, 3)",
        "INVALID_ARGUMENT: notice for layers [2, 4) from prefill rank 0; its overlap with decode rank 1 is [2, 3)",
    ),
    B4: BadCase(
        (W, F, W),
        "prefill rank 0 reports 100 bytes; 1 pages need 512",
        "INVALID_ARGUMENT: prefill rank 0 reports 100 bytes; 1 pages need 512",
    ),
    B5: BadCase((), "", "NOT_FOUND: room 181 is not expected on decode rank 1"),
}
ENGINES = {  # test id -> (engine, decode device, prefill device, bad cases)
    "shm": ("shm", "cpu", "cpu", DIRECT_CASES),
    "torch": ("torch", "cpu", "cpu", TORCH_CASES),
    "grpc": ("grpc", "cpu", "cpu", GRPC_CASES),
    "cuda_ipc": ("cuda_ipc", "cuda:0", "cuda:0", DIRECT_CASES),
    "torch_nccl": ("torch", "cuda:1", "cuda:0", TORCH_CASES),
}


def pushes(plan: RoomPlan) -> list[tuple[tuple, tuple, int]]:
    """(src pages, dst pages, tokens so far) per chunk: pages the chunk touched, partial ones again."""
    out = []
    for s in range(0, plan.prompt, plan.chunk):
        e = min(s + plan.chunk, plan.prompt)
        out.append((plan.src[s // PS : -(-e // PS)], plan.dst[s // PS : -(-e // PS)], e))
    return out


def prefill_buffer(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(GEOMETRY.pool_shape(NUM_PAGES, P_RANGES[rank]), generator=g)


def expected_pools() -> list[torch.Tensor]:
    pools = [torch.zeros(GEOMETRY.pool_shape(NUM_PAGES, r)) for r in D_RANGES]
    for plan in GOOD:
        for i, (ps, _) in enumerate(P_RANGES):
            for j, (ds, _) in enumerate(D_RANGES):
                both = overlap(P_RANGES[i], D_RANGES[j])
                if both is None:
                    continue
                for p, q in zip(plan.src, plan.dst):
                    for layer in range(*both):
                        pools[j][q, layer - ds] = prefill_buffer(i)[p, layer - ps]
    return pools


def call(fn, msg) -> str:
    try:
        fn(msg, timeout=10)
        return "OK"
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"


def wait_until(pred, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---- the decode process ----


def decode_main(engine: str, device: str, settle: dict, out, go) -> None:
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    receivers = [
        KVReceiverEndpoint(
            ReceiverConfig(j, lo, hi, NUM_PAGES, PS, 2, 8, device=device, awaits_first_token=j == 0, torch_timeout_s=30)
        )
        for j, (lo, hi) in enumerate(D_RANGES)
    ]
    prefill = NodeLayout(GEOMETRY, NUM_LAYERS, NUM_PAGES, tuple(RankInfo(i, *r) for i, r in enumerate(P_RANGES)))
    rooms = [(plan.room, plan.dst) for plan in PLANS] + [(b, BAD_PAGES) for b in (B1, B2, B3, B4)]
    for room, dst in rooms:
        for r in receivers:
            r.expect(room, f"rid-{room:x}", dst, sources_of(prefill), engine, KEY)
    out.put(("endpoints", [r.endpoint for r in receivers]))  # (RankInfo records, between our own processes)
    go.wait(TIMEOUT_S)
    wait_until(lambda: all(receivers[j].poll(room).is_terminal for room, ranks in settle.items() for j in ranks))
    report = {
        "states": {room: [r.poll(room).name for r in receivers] for room, _ in rooms},
        "reasons": {room: [r.reason(room) for r in receivers] for room, _ in rooms},
        "first_tokens": {plan.room: receivers[0].first_token(plan.room) for plan in GOOD},
        "mismatches": [
            (j, q)
            for j, (r, want) in enumerate(zip(receivers, expected_pools()))
            for q in range(NUM_PAGES)
            if not torch.equal(r.pool.buffer[q].cpu(), want[q])
        ],
        "segments": [
            (name, stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode))
            for r in receivers
            if (name := (r.endpoint.endpoint("shm") or b"").decode())
        ],
    }
    for r in receivers:
        r.close()
    report["left_after_close"] = [name for name, _ in report["segments"] if Path("/dev/shm", name).exists()]
    out.put(("decode", report))


# ---- the prefill process ----


def prefill_main(engine: str, device: str, endpoints: list, out) -> None:
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    ranks = tuple(endpoints)
    layout = NodeLayout(GEOMETRY, NUM_LAYERS, NUM_PAGES, ranks, "fp", BACKENDS, local_host_id())
    pools = [
        KVPool(NUM_PAGES, r, PS, 2, 8, torch.float32, device, buffer=prefill_buffer(i).to(device))
        for i, r in enumerate(P_RANGES)
    ]
    senders = [make_sender(engine, pool, i) for i, pool in enumerate(pools)]
    stub = kv_transfer_pb2_grpc.KVReceiverStub(make_channel(ranks[1].receiver_addr))
    bad = BAD_PHASES[engine](layout, senders, stub)
    good = run_plans(layout, senders)
    for s in senders:
        s.close()
    out.put(("prefill", {"bad": bad, "good": good}))


def run_plans(layout: NodeLayout, senders) -> dict:
    for plan in PLANS:
        for s in senders:
            s.connect(plan.room, layout, plan.dst, KEY, rid=f"rid-{plan.room:x}")
    senders[0].abort(ABORTED.room, "aborted by test")
    schedules = {plan.room: pushes(plan) for plan in GOOD}
    for step in range(max(len(s) for s in schedules.values())):  # rooms interleaved, chunk by chunk
        for plan in GOOD:
            for s in senders:
                if step < len(schedules[plan.room]):
                    s.push(plan.room, *schedules[plan.room][step])
    for plan in GOOD:  # the last rank samples; its first tokens go to decode rank 0
        senders[-1].send_first_token(plan.room, *FIRST_TOKENS[plan.room])
        for s in senders:
            s.finish(plan.room, plan.prompt)
    wait_until(lambda: all(s.poll(plan.room).is_terminal for plan in GOOD for s in senders), 60)
    return {plan.room: [(s.poll(plan.room).name, s.reason(plan.room)) for s in senders] for plan in PLANS}


def bad_grpc(layout, senders, stub) -> dict:
    def chunk(room, src, lo, hi, pages, nbytes=None):
        n = len(pages) * (hi - lo) * BLOCK if nbytes is None else nbytes
        c = kv_transfer_pb2.PageChunk(secret=KEY, room=room, src_rank=src, layer_start=lo, layer_end=hi, page_ids=pages)
        c.data = b"\1" * n
        return call(stub.WritePages, iter([c]))

    args = {B1: (0, 2, 3, [32]), B2: (0, 2, 3, [9]), B3: (0, 3, 4, [6]), B4: (0, 2, 3, [6], 100), B5: (0, 2, 3, [6])}
    return {room: chunk(room, *a) for room, a in args.items()}


def bad_torch(layout, senders, stub) -> dict:
    addr, key = layout.ranks[1].endpoint("torch").decode().split(" ")
    pair = PairClient(addr, key, 0, torch.device("cpu"), 30)
    one = torch.ones(1, 1, 2, PS, 2, 8)
    for room, lo, hi, page in ((B1, 2, 3, 32), (B2, 2, 3, 9), (B3, 3, 4, 6), (B5, 2, 3, 6)):
        pair.send(room, KEY, 0, lo, hi, [page], one)
    # sizes that do not add up: the decode rank closes the pair
    pair.send_header(Header(DATA, B4, 0, 2, 3, 1, 100, KEY))
    notice = kv_transfer_pb2.TransferNotice(
        secret=KEY, room=B5, src_rank=0, layer_start=2, layer_end=3, num_tokens=4, bytes=512
    )
    return {B5: call(stub.TransferDone, notice)}


def bad_direct(layout, senders, stub) -> dict:
    out = {}
    senders[1].connect(B1, layout, [32], KEY)
    wait_until(lambda: senders[1].poll(B1).is_terminal)
    out[B1] = f"{senders[1].poll(B1).name}: {senders[1].reason(B1)}"
    senders[0].connect(B2, layout, BAD_PAGES, KEY)
    try:
        senders[0].push(B2, [0], [9], 4)
    except ValueError as e:
        out[B2] = f"ValueError: {e}"

    def notice(room, src, lo, hi, nbytes):
        msg = kv_transfer_pb2.TransferNotice(
            secret=KEY, room=room, src_rank=src, layer_start=lo, layer_end=hi, num_tokens=4
        )
        msg.bytes = nbytes
        return call(stub.TransferDone, msg)

    out[B3] = notice(B3, 0, 2, 4, BLOCK)
    notice(B4, 0, 2, 3, 100)
    out[B4] = notice(B4, 1, 3, 4, BLOCK)
    out[B5] = notice(B5, 0, 2, 3, BLOCK)
    return out


BAD_PHASES = {"grpc": bad_grpc, "torch": bad_torch, "shm": bad_direct, "cuda_ipc": bad_direct}


# ---- the test process ----


def run_engine(engine: str, d_device: str, p_device: str, cases: dict) -> dict:
    settle = {plan.room: [0, 1, 2] for plan in GOOD} | {ABORTED.room: [0, 1]}
    settle |= {room: [j for j, s in enumerate(c.d_states) if s == F] for room, c in cases.items() if c.d_states}
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    faulthandler.dump_traceback_later(TIMEOUT_S + 30, exit=True)
    d = ctx.Process(target=decode_main, args=(engine, d_device, settle, out, go), daemon=True)
    d.start()
    kind, endpoints = out.get(timeout=TIMEOUT_S)
    p = ctx.Process(target=prefill_main, args=(engine, p_device, endpoints, out), daemon=True)
    p.start()
    results = {}
    for _ in range(2):
        kind, value = out.get(timeout=TIMEOUT_S)
        results[kind] = value
        go.set()  # the prefill side is done
    p.join(30)
    d.join(30)
    faulthandler.cancel_dump_traceback_later()
    assert (p.exitcode, d.exitcode) == (0, 0)
    return results


def _needs(test_id: str):
    if test_id == "cuda_ipc":
        return pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent: cuda_ipc moves GPU pools")
    if test_id == "torch_nccl":
        reason = "needs 2 CUDA devices: NCCL refuses two ranks of one group on one GPU"
        return pytest.mark.skipif(torch.cuda.device_count() < 2, reason=reason)
    return []


@pytest.fixture(scope="module", params=[pytest.param(k, marks=_needs(k)) for k in ENGINES])
def run(request):
    engine, d_device, p_device, cases = ENGINES[request.param]
    return run_engine(engine, d_device, p_device, cases), cases, d_device


def test_decode_pools_hold_exactly_the_pushed_pages_and_zeros_elsewhere(run):
    results, _, _ = run
    assert results["decode"]["mismatches"] == []


def test_good_rooms_succeed_on_every_rank_of_both_sides(run):
    results, _, _ = run
    for plan in GOOD:
        assert results["decode"]["states"][plan.room] == ["SUCCESS"] * 3
        assert results["prefill"]["good"][plan.room] == [("SUCCESS", "")] * 2


def test_first_tokens_reach_decode_rank_zero(run):
    results, _, _ = run
    assert results["decode"]["first_tokens"] == FIRST_TOKENS


def test_an_abort_fails_exactly_the_decode_ranks_the_aborting_rank_feeds(run):
    results, _, _ = run
    # prefill rank 0 ([0, 3)) feeds decode ranks 0 ([0, 2)) and 1 ([2, 4)), not 2 ([4, 6))
    assert results["decode"]["states"][ABORTED.room] == ["FAILED", "FAILED", "WAITING_FOR_INPUT"]
    assert results["decode"]["reasons"][ABORTED.room] == [*["prefill rank 0: aborted by test"] * 2, ""]
    assert results["prefill"]["good"][ABORTED.room] == [("FAILED", "aborted by test"), ("WAITING_FOR_INPUT", "")]


def test_bad_inputs_fail_their_room_with_a_clear_reason(run):
    results, cases, _ = run
    for room, case in cases.items():
        if case.d_states:
            assert results["decode"]["states"][room] == list(case.d_states), hex(room)
            assert results["decode"]["reasons"][room] == [case.d_reason if s == F else "" for s in case.d_states]
        if case.p_result is not None:
            assert results["prefill"]["bad"][room] == case.p_result, hex(room)


def test_pool_segments_are_owner_only_while_open_and_gone_after_close(run):
    results, _, d_device = run
    segments = results["decode"]["segments"]
    assert len(segments) == (3 if d_device == "cpu" else 0)  # CPU pools live in /dev/shm, CUDA pools do not
    assert all(mode == 0o600 for _, mode in segments)
    assert results["decode"]["left_after_close"] == []
    assert not [name for name, _ in segments if Path("/dev/shm", name).exists()]
