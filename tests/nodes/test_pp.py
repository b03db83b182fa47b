"""Multi-process pipeline parallelism: same tokens as one process, one decision log on every rank."""

from __future__ import annotations

import random

import pytest

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.batch import ForwardBatch
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.pipeline.group import RankGroup
from kvbridge.pipeline.log import ABORT, ADMIT, STEP, Admitted, LogEntry, Message
from kvbridge.pipeline.messages import Finish
from tests.conftest import make_llm, make_prompts

TINY = {"model": "tiny-random", "page_size": 4, "kv_cache_tokens": 8192}
HARD_TIMEOUT_S = 240  # each test that takes hard_timeout_per_test (tests/conftest.py)


def make_node(pp_size: int, **overrides) -> RankGroup:
    pp_keys = {"async_batch_depth", "enable_dynamic_chunking"}
    pp = PPConfig(pp_size=pp_size, **{k: v for k, v in overrides.items() if k in pp_keys})
    config = EngineConfig(**{**TINY, **{k: v for k, v in overrides.items() if k not in pp_keys}})
    return RankGroup(config, pp, progress=False)


def test_message_round_trip_and_malformed_bytes_are_refused():
    batch = ForwardBatch(("a", "b"), (0, 7), (5, 1), ((3, 4), (9, 2)), (), (True, False))
    params = SamplingParams(max_new_tokens=3, temperature=0.5, stop=("x",), seed=4)
    msg = Message(STEP, (LogEntry(0, ADMIT, "a", params, Admitted()), LogEntry(1, ABORT, "c")), batch)
    assert Message.decode(msg.encode()) == msg
    for bad in (b"", b"{}", b"[1]", b'{"kind":"step","decisions":[[0,"boom","a",null]],"batch":null}'):
        with pytest.raises(ValueError, match="malformed pipeline message"):
            Message.decode(bad)


@pytest.mark.parametrize(
    ("pp_size", "overrides"),
    [
        pytest.param(2, {"chunked_prefill_size": 16}, id="pp2-chunked"),
        pytest.param(3, {"chunked_prefill_size": 0}, id="pp3-unchunked"),
        pytest.param(3, {"chunked_prefill_size": 16, "async_batch_depth": 2}, id="pp3-chunked-async2"),
        pytest.param(2, {"chunked_prefill_size": 32, "enable_dynamic_chunking": True}, id="pp2-dynamic"),
        pytest.param(3, {"chunked_prefill_size": 16, "enable_dynamic_chunking": True}, id="pp3-dynamic"),
    ],
)
def test_pipeline_output_equals_one_process(tiny_model, hard_timeout_per_test, pp_size, overrides):
    prompts = make_prompts(10, tiny_model.config.vocab_size, seed=21, min_len=1, max_len=150)
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 7
    params += [SamplingParams(max_new_tokens=16, temperature=1.0, top_k=20, seed=s, ignore_eos=True) for s in range(3)]
    single = {k: v for k, v in overrides.items() if k in ("chunked_prefill_size",)}
    expected = [c.output_ids for c in make_llm(tiny_model, **single).generate(prompts, params)]
    node = make_node(pp_size, **overrides)
    try:
        got = [c.output_ids for c in node.generate(prompts, params, timeout_s=120)]
    finally:
        reports = node.shutdown()
    assert got == expected
    assert [r.error for r in reports] == [""] * pp_size
    assert all(r.log == reports[0].log for r in reports)
    assert len(reports[0].log) == 2 * len(prompts)  # one ADMIT and one FINISH each
    assert reports[0].pages_used == 0


def test_abort_storm_leaves_identical_logs_and_no_page_behind(tiny_model, hard_timeout_per_test):
    rng = random.Random(7)
    n = 200
    prompts = make_prompts(n, tiny_model.config.vocab_size, seed=22, min_len=2, max_len=60)
    params = [SamplingParams(max_new_tokens=rng.randint(2, 24), ignore_eos=True) for _ in range(n)]
    to_abort = set(rng.sample(range(n), n // 3))
    node = make_node(3, chunked_prefill_size=24, async_batch_depth=1, max_running_requests=24)
    finished: dict[str, Finish] = {}
    try:
        rids = [node.add_request(p, sp) for p, sp in zip(prompts, params)]
        pending_aborts = [rids[i] for i in sorted(to_abort, key=lambda _: rng.random())]
        while len(finished) < n:
            for ev in node.poll(timeout=0.05):
                if isinstance(ev, Finish):
                    finished[ev.rid] = ev
            # abort at random moments: a few at a time, between polls, some before they start
            for _ in range(rng.randint(0, 3)):
                if pending_aborts:
                    node.abort(pending_aborts.pop())
    finally:
        reports = node.shutdown()
    reasons = {rid: ev.finish_reason for rid, ev in finished.items()}
    assert set(reasons) == set(rids)
    aborted = {i for i, rid in enumerate(rids) if reasons[rid] == "abort"}
    assert aborted <= to_abort and len(aborted) >= len(to_abort) // 2
    assert all(reasons[rids[i]] == "length" for i in range(n) if i not in aborted)
    # the requests that ran to the end produced exactly the single-process tokens
    survivors = [i for i in range(n) if i not in aborted]
    expected = make_llm(tiny_model).generate([prompts[i] for i in survivors], [params[i] for i in survivors])
    assert [list(finished[rids[i]].output_ids) for i in survivors] == [c.output_ids for c in expected]
    assert [r.error for r in reports] == ["", "", ""]
    assert reports[1].log == reports[0].log and reports[2].log == reports[0].log
    assert len({r.log_digest for r in reports}) == 1 and reports[0].log_count == len(reports[0].log)
    kinds = [k for _, k, _ in reports[0].log]
    assert kinds.count(ABORT) + kinds.count("finish") == kinds.count(ADMIT)  # every admitted rid retired once
    assert [r.live_requests for r in reports] == [0, 0, 0]
    assert reports[0].pages_used == 0


def test_two_hosts_share_one_pipeline(tiny_model, hard_timeout_per_test):
    """--num_hosts 2: each "host" (here: a RankGroup on the same machine) starts its own ranks."""
    import threading

    from kvbridge.common.net import free_port

    addr = f"127.0.0.1:{free_port()}"
    config = EngineConfig(**TINY, chunked_prefill_size=16)
    nodes = {}

    def start(host_rank: int) -> None:
        pp = PPConfig(pp_size=4, num_hosts=2, host_rank=host_rank, dist_init_addr=addr)
        nodes[host_rank] = RankGroup(config, pp, progress=False)

    second = threading.Thread(target=start, args=(1,))
    second.start()
    start(0)  # returns once every rank of the world has joined
    second.join(timeout=60)
    assert [p.name for p in nodes[1].procs] == ["kvbridge-pp2", "kvbridge-pp3"]
    prompts = make_prompts(4, tiny_model.config.vocab_size, seed=23)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    try:
        got = [c.output_ids for c in nodes[0].generate(prompts, params, timeout_s=60)]
    finally:
        front = nodes[0].shutdown()
        back = nodes[1].shutdown()  # its ranks stop on the pipeline's own shutdown message
    assert got == [c.output_ids for c in make_llm(tiny_model, chunked_prefill_size=16).generate(prompts, params)]
    assert [r.rank for r in front + back] == [0, 1, 2, 3]
    assert all(r.log == front[0].log for r in back) and len(front[0].log) == 8
