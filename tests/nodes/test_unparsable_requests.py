"""Request messages that do not parse (a string field with bad UTF-8, a truncated field), sent as
raw bytes to every kind of call a node serves: each ends INVALID_ARGUMENT naming what the parser
found (grpcio alone answers UNKNOWN), and the node serves on."""

from __future__ import annotations

import time

import grpc
import pytest

from kvbridge.common.rpc import make_channel
from kvbridge.engine.config import PPConfig
from kvbridge.kv_transfer import KVReceiverEndpoint
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import admin_pb2
from tests.kv_transfer.test_kv_transfer_receiver import make_config
from tests.pd import TINY, admin

BAD_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (a string: rid) holding the bytes ff fe
TRUNCATED = b"\x0a\x05ab"  # field 1 says 5 bytes follow, 2 do

BAD_UTF8_ERROR = "String field had bad UTF-8"
TRUNCATED_ERROR = "Wire format was corrupt"


@pytest.fixture(scope="module")
def prefill():
    node = start_node("prefill", NodeConfig(TINY, PPConfig()))
    yield node
    node.stop()


def raw_call(addr: str, method: str, data: bytes, streaming: bool = False) -> grpc.RpcError:
    channel = make_channel(addr)
    try:
        if streaming:
            call = channel.unary_stream(method, request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.RpcError) as e:
                list(call(data, timeout=30))
        else:
            call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.RpcError) as e:
                call(data, timeout=30)
        return e.value
    finally:
        channel.close()


UNARY = [
    ("/kvbridge.v1.Prefill/Prefill", "kvbridge.v1.PrefillRequest"),
    ("/kvbridge.v1.Bootstrap/Register", "kvbridge.v1.RegisterRequest"),
    ("/kvbridge.v1.Admin/AbortRequest", "kvbridge.v1.AbortRequestRequest"),
]
CASES = [
    *(
        (m, t, False, data, why)
        for m, t in UNARY
        for data, why in ((BAD_UTF8, BAD_UTF8_ERROR), (TRUNCATED, TRUNCATED_ERROR))
    ),
    ("/kvbridge.v1.KVEvents/Watch", "kvbridge.v1.WatchKVEventsRequest", True, TRUNCATED, TRUNCATED_ERROR),
]


@pytest.mark.parametrize("method, message, streaming, data, why", CASES)
def test_a_request_that_does_not_parse_is_invalid_argument_and_the_node_serves_on(
    prefill, method, message, streaming, data, why
):
    e = raw_call(prefill.address, method, data, streaming)
    assert (e.code(), e.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request does not parse: Error parsing message with type '{message}': {why}",
    )
    assert not prefill.dead
    requests = admin(prefill.address).ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests
    assert list(requests) == []


def test_a_page_chunk_that_does_not_parse_ends_its_stream_invalid_argument():
    with KVReceiverEndpoint(make_config()) as receiver:
        channel = make_channel(receiver.endpoint.receiver_addr)
        call = channel.stream_unary(
            "/kvbridge.v1.KVReceiver/WritePages", request_serializer=bytes, response_deserializer=bytes
        )
        with pytest.raises(grpc.RpcError) as e:
            call(iter([b"\x08\x01" + TRUNCATED]), timeout=30)
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request does not parse: Error parsing message with type 'kvbridge.v1.PageChunk': {TRUNCATED_ERROR}",
        )
        deadline = time.monotonic() + 10  # (the stream's slot is given back just after its status went out)
        while receiver.servicer.waiting.count() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.servicer.waiting.count() == 0
        channel.close()
