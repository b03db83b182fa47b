"""Factories for disaggregated tests: nodes started in parallel, a direct P+D dispatch, idle checks."""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.request import urlopen

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.common import rpc
from kvbridge.common.security import message_proof
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

TINY = EngineConfig(model="tiny-random", page_size=4, kv_cache_tokens=4096, chunked_prefill_size=16)


def fleet_signed(msg, nonce: bytes = b""):
    """`msg` with its proof set as a fleet member sets it: this test process holds the fleet key of
    the nodes it starts in-process (the default file's)."""
    msg.proof = message_proof(rpc.security().fleet(), msg, nonce)
    return msg


def signed_route(room: int, prefill_addr: str) -> generation_pb2.PrefillRoute:
    """A PrefillRoute as the router makes it."""
    return fleet_signed(generation_pb2.PrefillRoute(room=room, prefill_addr=prefill_addr))


def start_nodes(specs: dict[str, tuple], config: EngineConfig = TINY, elastic: bool = False) -> dict:
    """specs: name -> ("prefill", pp) or ("decode", pp, backend); started in parallel (elastic: with
    --elastic, each in the role it is named with)."""

    def start(spec):
        if spec[0] == "prefill":
            engine = config if len(spec) < 3 else spec[2]
            return start_node("prefill", NodeConfig(engine, PPConfig(pp_size=spec[1]), elastic=elastic))
        return start_node(
            "decode",
            NodeConfig(
                config if len(spec) < 4 else spec[3], PPConfig(pp_size=spec[1]), transfer_backend=spec[2],
                elastic=elastic,
            ),
        )  # fmt: skip

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start, spec) for name, spec in specs.items()}
        return {name: f.result() for name, f in futures.items()}


def stop_nodes(nodes: dict) -> None:
    with ThreadPoolExecutor(max(1, len(nodes))) as pool:
        list(pool.map(lambda n: n.stop(), nodes.values()))


def token_prompt(ids: list[int]) -> common_pb2.Prompt:
    return common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids))


def pd_generate(
    p_addr: str,
    d_addr: str,
    prompt: common_pb2.Prompt,
    max_new_tokens: int,
    timeout: float = 120,
    late: bool = False,
    sampling: common_pb2.SamplingParams | None = None,
    salt: str = "",
):
    """What the router does for one request: D.Generate (stream) and P.Prefill at once (late: D only
    once P has prefilled the prompt and holds its first token, waiting for the registration); P gets
    no `n` (it computes choice 0). Returns (tokens, decode responses, prefill response or the
    RpcError of either half)."""
    rid, room = secrets.token_hex(8), secrets.randbits(63)
    sampling = sampling or common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    p_sampling = common_pb2.SamplingParams()
    p_sampling.CopyFrom(sampling)
    p_sampling.ClearField("n")
    prefill = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p_addr)).Prefill.future(
        prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=prompt, sampling=p_sampling, cache_salt=salt),
        timeout=timeout,
    )
    if late:  # prefilled: its first token sampled, its pages held
        info = wait_phase(p_addr, rid, "bootstrap")
        assert info.output_tokens == 1 and info.kv_pages > 0 and info.peer == "", info
    req = generation_pb2.GenerateRequest(
        rid=rid,
        prompt=prompt,
        sampling=sampling,
        prefill=signed_route(room, p_addr),
        cache_salt=salt,
    )
    stream = generation_pb2_grpc.GenerationStub(rpc.make_channel(d_addr)).Generate(req, timeout=timeout)
    try:
        responses = list(stream)
    except grpc.RpcError as e:
        prefill.cancel()
        return [], [], e
    return [t for r in responses for t in r.token_ids], responses, prefill.result()


def metric_total(node, sample: str) -> float:
    """The sum of the node's Prometheus samples named `sample` (its /metrics, every label)."""
    text = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == sample)


def admin(addr: str) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(rpc.make_channel(addr))


def status(addr: str) -> admin_pb2.Status:
    return admin(addr).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)


def clear_cache(*addrs: str) -> int:
    """Empty the nodes' prefix caches (a test that counts moved bytes starts from none cached)."""
    return sum(admin(a).ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=10).pages_dropped for a in addrs)


def wait_idle(addr: str, timeout: float = 30) -> admin_pb2.Status:
    """The node's status once no page is used and every queue is empty (cleanup is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(addr)
        if all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values()):
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def wait_phase(addr: str, rid: str, phase: str, timeout: float = 60) -> admin_pb2.RequestInfo:
    stub = admin(addr)
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in stub.ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests if r.rid == rid]
        if found and found[0].phase == phase:
            return found[0]
        assert time.monotonic() < deadline, f"{rid} never reached phase {phase} on {addr}: {found}"
        time.sleep(0.01)


def in_parallel(fn, args_list: list) -> list:
    results = [None] * len(args_list)

    def run(i, args):
        results[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
