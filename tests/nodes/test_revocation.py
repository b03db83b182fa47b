"""A decode node that gives up on a room keeps its pages out of use until the prefill node has
revoked the room on every rank (Bootstrap.Revoke), on real processes: no prefill rank writes after
that, the pages are reused only then, and the next request on them decodes what a colocated engine
does. If the prefill node dies instead, they are released after a grace; a bad Revoke changes nothing.

The prefill node P (pp 2) never sends its rank 1's "all pages sent" notice (`drop_notice`), so a
request's hand-off stays under way on both sides until the decode node D (pp 2, shm) gives up
(its 2 s transfer timeout): D's pages could still be written by P's ranks. D reaches P through a
gate in this process that passes GetLayout and Register on and holds each Revoke until the test
opens it, so every check below runs in a state nothing else can change. P2 (pp 1) serves the
requests that follow, on the pages D gave back (D's pool holds one request)."""

from __future__ import annotations

import secrets
import threading
from dataclasses import replace
from urllib.request import urlopen

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.common.security import message_proof
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import (
    admin_pb2,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.conftest import make_llm
from tests.pd import (
    TINY,
    admin,
    fleet_signed,
    pd_generate,
    signed_route,
    status,
    stop_nodes,
    token_prompt,
    wait_idle,
    wait_phase,
)

pytestmark = pytest.mark.usefixtures("hard_timeout")  # 600 s for the module (tests/conftest.py)

MAX_NEW = 8
PROMPT_PAGES = 6  # a 24-token prompt in pages of 4; with MAX_NEW's 2 pages of room, D's whole pool
WAIT_S = 60.0  # a bound on waiting for what must come (a hang fails, it does not stall)
D_TRANSFER_TIMEOUT_S = 2.0  # D gives up this long after it reserved a request's pages
TIMED_OUT = f"the KV cache did not arrive within {D_TRANSFER_TIMEOUT_S:g} s"
FOLLOWING = [[(7 * i + 3) % 200 + 1 for i in range(24)], [(11 * i + 5) % 200 + 1 for i in range(24)]]


class RevokeGate(prefill_pb2_grpc.BootstrapServicer):
    """P's Bootstrap seen through a gate: GetLayout and Register go on to P as they are (the proofs are
    P's and D's own), and each Revoke waits until the test opens the gate, then goes on too."""

    def __init__(self, target: str):
        self.stub = prefill_pb2_grpc.BootstrapStub(rpc.make_channel(target))
        self.registered: dict[int, prefill_pb2.RegisterRequest] = {}  # room -> D's registration
        self.revokes: list[int] = []  # rooms, as the Revoke calls came
        self.answers: list[str] = []  # P's answer to each Revoke passed on (a status code's name)
        self.arrived, self.gate = threading.Event(), threading.Event()
        add = prefill_pb2_grpc.add_BootstrapServicer_to_server
        self.server, port, _ = rpc.make_server("127.0.0.1", 0, [(add, self)], ["kvbridge.v1.Bootstrap"])
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def GetLayout(self, request, context):
        return self._on(self.stub.GetLayout, request, context)

    def Register(self, request, context):
        self.registered[request.room] = request
        return self._on(self.stub.Register, request, context)

    def Revoke(self, request, context):
        self.revokes.append(request.room)
        self.arrived.set()
        if not self.gate.wait(WAIT_S) or not context.is_active():  # (stopped: the call is gone, P is not told)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the gate never opened")
        try:
            answer = self.stub.Revoke(request, timeout=WAIT_S)
        except grpc.RpcError as e:
            self.answers.append(e.code().name)
            context.abort(e.code(), e.details())
        self.answers.append("OK")
        return answer

    def _on(self, call, request, context):
        try:
            return call(request, timeout=WAIT_S)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details())

    def stop(self) -> None:
        """Gone, as a dead node is: every call ends, connections reset; a Revoke held is not passed on."""
        self.server.stop(0).wait()
        self.gate.set()  # (its worker thread ends)


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    p_config = replace(TINY, fault_inject="rank1:drop_notice=1", transfer_timeout_s=300.0)
    d_config = replace(TINY, kv_cache_tokens=4 * (PROMPT_PAGES + MAX_NEW // 4), transfer_timeout_s=D_TRANSFER_TIMEOUT_S)
    configs = {
        "p": ("prefill", NodeConfig(p_config, PPConfig(pp_size=2), metrics_port=0)),
        "p2": ("prefill", NodeConfig(TINY, PPConfig())),
        "d": ("decode", NodeConfig(d_config, PPConfig(pp_size=2), transfer_backend="shm", metrics_port=0)),
    }
    nodes = {}
    try:
        for name, (role, config) in configs.items():
            nodes[name] = start_node(role, config)
        yield nodes
    finally:
        stop_nodes(nodes)


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    return [c.output_ids for c in llm.generate(FOLLOWING, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))]


@pytest.fixture
def gate(fleet):
    made = RevokeGate(fleet["p"].address)
    yield made
    made.stop()


def samples(node, name: str) -> dict[tuple, float]:
    """The node's samples of series `name` (its /metrics), by their labels' values."""
    text = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                found[tuple(sorted(s.labels.items()))] = s.value
    return found


def revoked_per_rank(p) -> dict[str, float]:
    return {dict(k)["rank"]: v for k, v in samples(p, "kvbridge_kv_rooms_revoked_total").items()}


def releases(d) -> dict[str, float]:
    return {dict(k)["reason"]: v for k, v in samples(d, "kvbridge_kv_quarantine_releases_total").items()}


def pushed_per_rank(p) -> dict[str, float]:
    return {dict(k)["rank"]: v for k, v in samples(p, "kvbridge_kv_transfer_bytes_total").items()}


def given_up(p, d, gate: RevokeGate, prompt: list[int]):
    """A request P prefills and D gives up on (D reaches P through the gate): (P's Prefill call, its
    rid, the room, D's error). Returns once D's Revoke is held at the gate."""
    rid, room = secrets.token_hex(8), secrets.randbits(63)
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    prefill = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p.address)).Prefill.future(
        prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=token_prompt(prompt), sampling=sampling), timeout=WAIT_S
    )
    req = generation_pb2.GenerateRequest(
        rid=rid, prompt=token_prompt(prompt), sampling=sampling, prefill=signed_route(room, gate.address)
    )
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(d.address)).Generate(req, timeout=WAIT_S))
    assert gate.arrived.wait(WAIT_S), "the decode node never revoked the room"
    assert gate.revokes == [room]
    return prefill, rid, room, e.value


def phase_on(addr: str, rid: str) -> str:
    listed = admin(addr).ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests
    return next((r.phase for r in listed if r.rid == rid), "gone")


def revoke(addr: str, room: int, proof: bytes | None = None) -> grpc.RpcError:
    """A Revoke sent to `addr` straight, signed as a fleet member signs it unless `proof` is given."""
    request = prefill_pb2.RevokeRequest(room=room)
    request = fleet_signed(request) if proof is None else prefill_pb2.RevokeRequest(room=room, proof=proof)
    with pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.BootstrapStub(rpc.make_channel(addr)).Revoke(request, timeout=WAIT_S)
    return e.value


def test_pages_of_a_room_the_decode_node_gave_up_on_are_reused_only_after_every_prefill_rank_revoked_it(
    fleet, gate, reference
):
    p, p2, d = fleet["p"], fleet["p2"], fleet["d"]
    prefill, rid, room, error = given_up(p, d, gate, list(range(1, 25)))
    assert (error.code(), error.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED, TIMED_OUT)
    assert room in gate.registered  # (D's Revoke comes after its Register ended)

    # held at the gate: D keeps the room's pages, P's request is still handing off, no rank revoked it
    assert [r.kv_pages_used for r in status(d.address).ranks] == [PROMPT_PAGES, PROMPT_PAGES]
    assert releases(d) == {} and revoked_per_rank(p) == {}
    wait_phase(p.address, rid, "transferring")  # (P computed the prompt: it waits for rank 1's notice, for ever)
    pushed = pushed_per_rank(p)
    assert set(pushed) == {"0", "1"} and all(pushed.values())
    # D's rank 0 forgot the room on its ABORT: its key opens nothing there any more
    secret = gate.registered[room].secret
    notice = kv_transfer_pb2.TransferNotice(
        room=room, src_rank=0, layer_start=0, layer_end=1, num_tokens=1, secret=secret
    )
    receiver = kv_transfer_pb2_grpc.KVReceiverStub(rpc.make_channel(d.node.layout.ranks[0].receiver_addr))
    with pytest.raises(grpc.RpcError) as e:
        receiver.TransferDone(notice, timeout=10)
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.NOT_FOUND,
        f"room {room} is not expected on decode rank 0",
    )

    # bad Revokes, to P straight: refused, and nothing changed
    other = message_proof(b"k" * 32, prefill_pb2.RevokeRequest(room=room))
    unsigned_error = (
        f"room {room}: revocation not signed by a fleet member (RevokeRequest.proof is not the fleet key's; "
        "SECURITY.md)"
    )
    for proof in (b"", other):
        e = revoke(p.address, room, proof)
        assert (e.code(), e.details()) == (grpc.StatusCode.PERMISSION_DENIED, unsigned_error)
    unknown = room ^ 1
    e = revoke(p.address, unknown)
    assert (e.code(), e.details()) == (
        grpc.StatusCode.NOT_FOUND,
        f"room {unknown} is not known here: nothing of this node writes it",
    )
    e = revoke(p.address, 0)
    assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "room is required")
    assert phase_on(p.address, rid) == "transferring"
    assert revoked_per_rank(p) == {} and pushed_per_rank(p) == pushed
    assert [r.kv_pages_used for r in status(d.address).ranks] == [PROMPT_PAGES, PROMPT_PAGES]

    # the gate opens: P ends the request, each of its ranks drops the room, then P answers and D frees the pages
    gate.gate.set()
    e = prefill.exception(timeout=WAIT_S)
    assert (e.code(), e.details()) == (
        grpc.StatusCode.CANCELLED,
        f"the decode node gave up on room {room} (Bootstrap.Revoke)",
    )
    st = wait_idle(d.address)
    assert [r.kv_pages_used for r in st.ranks] == [0, 0]
    assert gate.answers == ["OK"]
    assert revoked_per_rank(p) == {"0": 1.0, "1": 1.0}
    assert releases(d) == {"revoked": 1.0}
    assert pushed_per_rank(p) == pushed  # no rank of P wrote anything after D gave up

    # the next request takes those pages (D's pool holds one request) and decodes as a colocated engine does
    tokens, responses, prefill_result = pd_generate(p2.address, d.address, token_prompt(FOLLOWING[0]), MAX_NEW)
    assert not isinstance(prefill_result, grpc.RpcError), prefill_result
    assert tokens == reference[0]
    assert responses[0].transfer.kv_bytes > 0
    for node in (p, p2, d):
        assert all(r.kv_pages_used == 0 for r in wait_idle(node.address).ranks)


@pytest.mark.long  # (the grace: 6 s)
def test_pages_of_a_prefill_node_that_is_gone_are_released_after_a_grace(fleet, gate, reference):
    p, p2, d = fleet["p"], fleet["p2"], fleet["d"]
    before = releases(d)
    prefill, _, _, error = given_up(p, d, gate, list(range(101, 125)))
    assert (error.code(), error.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED, TIMED_OUT)
    assert [r.kv_pages_used for r in status(d.address).ranks] == [PROMPT_PAGES, PROMPT_PAGES]
    gate.stop()  # "P" (as D knows it: the gate's address) is gone: its health stream breaks, the Revoke with it
    st = wait_idle(d.address)
    assert [r.kv_pages_used for r in st.ranks] == [0, 0]
    assert releases(d) == {**before, "prefill_gone": 1.0}
    tokens, _, prefill_result = pd_generate(p2.address, d.address, token_prompt(FOLLOWING[1]), MAX_NEW)
    assert not isinstance(prefill_result, grpc.RpcError), prefill_result
    assert tokens == reference[1]
    prefill.cancel()  # (the real P still holds the request: its client goes away)
    assert wait_idle(p.address).requests_in_flight == 0
