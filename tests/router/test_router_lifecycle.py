"""Every request the router accepts ends, whatever order the client's disconnect, the node's answer
and a timeout arrive in: its rid leaves the dispatcher and its nodes are released (outstanding 0).
The fleet-wide storm (real nodes, pages, fds, threads) is tests/e2e/test_storm.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from kvbridge.router.answer import Fanout
from tests.router.fakes import make_request, wait_until
from tests.router.test_router_http import first_event

PROMPTS = 3  # of the prompt list: Fanout's queue holds this many responses
STREAMS = 30


def settled(router) -> tuple[int, dict[str, int]]:
    """The router's requests in flight and each node's outstanding count."""
    return router.dispatcher.num_in_flight(), router.pool.outstanding()


async def read_one_then_close(router, responses_held: int) -> None:
    """Open a prompt list, take one response, wait until `responses_held` more have reached the
    router (queued, or held by a pump waiting for room in the queue), then close the answer."""
    fanout = Fanout([router.dispatcher.route(make_request(ids=(1, 2, 3 + i))) for i in range(PROMPTS)])
    async with contextlib.aclosing(fanout):
        await anext(aiter(fanout))
        while sum(r.sent for r in fanout.routes) < 1 + responses_held:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("roles", [{"colocated": 1}, {"prefill": 1, "decode": 1}])
def test_a_prompt_list_closed_while_every_choice_waits_on_a_full_queue_ends_every_request(fleet, roles):
    # the queue full (PROMPTS responses) and each pump holding one more: every routed request is
    # suspended at a response no one takes; closing the answer must still end each one
    router, _ = fleet(tokens=8, **roles)
    router.loop.run(read_one_then_close(router, responses_held=2 * PROMPTS), timeout=30)
    assert settled(router) == (0, {key: 0 for key in router.pool.outstanding()})


def test_a_prompt_list_closed_with_nothing_waiting_ends_every_request(fleet):
    router, _ = fleet(colocated=1, tokens=8)
    router.loop.run(read_one_then_close(router, responses_held=0), timeout=30)
    assert settled(router) == (0, {key: 0 for key in router.pool.outstanding()})


def test_streamed_prompt_lists_whose_clients_read_one_event_and_leave_end_upstream(fleet):
    # the case: before the fix, about a third of these stayed in flight with their node held
    router, nodes = fleet(colocated=1, tokens=200, token_s=0.002)
    # each call streams a few tokens, then waits until it is cancelled: none can complete on its own
    # while the router is slow to cancel (a loaded host), so every one of them must be cancelled
    nodes["colocated"][0].stall_after = 4
    body = b'{"prompt": [[1, 2], [3, 4], [5, 6], [7, 8]], "max_tokens": 200, "stream": true}'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    for _ in range(STREAMS):
        with socket.create_connection(("127.0.0.1", router.http_port), timeout=30) as sock:
            sock.sendall(head.encode() + b"\r\n\r\n" + body)
            assert first_event(sock)["object"] == "text_completion"
    assert wait_until(lambda: settled(router) == (0, {key: 0 for key in router.pool.outstanding()}))
    # every call that reached the node is cancelled there (one the router cancelled before it reached
    # the node, the client gone after the first prompt's event, never does: nothing of it is held)
    node = nodes["colocated"][0]
    assert wait_until(lambda: len(node.cancelled) == len(node.requests) > 3 * STREAMS) and node.completed == []
