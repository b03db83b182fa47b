"""The HTTP answer to one OpenAI generation request (`HTTPAnswer`, an ASGI app), and the routed requests
behind it (`Fanout`: one a prompt; a completion may list several).

One JSON body once every routed request ended, or an event per response as it comes ("stream":
true). The status waits for the first response, so a request that fails before any gets its own
status; one that fails later ends its stream with an error event. A task watches the client
meanwhile: gone, every routed request is cancelled upstream.

The loop stays free for other requests (and /health) however large the answer: a response whose
part is made from over INLINE_RESPONSE_BYTES (Reply.cost: a prompt's logprobs, echoed and as
prompt_logprobs, come again on every choice's first event: a 1,000-token prompt's with 20
alternatives make a 1.5 MB event, ~0.2 s of work) is made into its part of the answer in the
router's worker thread (router/worker.py), and a stream lets the loop run after each YIELD_BYTES of
events sent (Fanout queues responses: several can come without a wait between them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvbridge.common.heap import release_freed_heap
from kvbridge.router.failures import RouteError
from kvbridge.router.openai_api import error_body
from kvbridge.router.reply import Reply
from kvbridge.router.routed import CLIENT_CANCELLED, Routed
from kvbridge.router.worker import json_pieces, offloaded
from kvbridge.v1 import generation_pb2

SEND_BYTES = 1 << 20  # a whole answer goes out in writes of about this many bytes
INLINE_RESPONSE_BYTES = 16 << 10  # a response whose Reply.cost is up to this is added on the loop (~5 ms at most)
YIELD_BYTES = 1 << 20  # a stream's events sent before the loop runs other tasks, at most (and one event more)


class Fanout:
    """The routed requests of one answer, one a prompt: `async for (prompt, response)` yields each
    response as it comes, tagged with its prompt's index. The first failure (RouteError) ends them
    all: the others are cancelled upstream. Closing it (`aclose`) or cancel() cancels every one.

    Each routed request has one owner that closes it however its iteration stops (a Routed ends,
    and leaves the dispatcher, only when its generator is closed or finished): `_one` for a single
    prompt, else the pump task that reads it. Closing the Fanout closes `_one`, or cancels every
    pump and waits for them."""

    def __init__(self, routes: list[Routed]):
        self.routes = routes
        self.rid = routes[0].rid
        self._responses: AsyncIterator[tuple[int, generation_pb2.GenerateResponse]] | None = None

    def cancel(self, why: str = CLIENT_CANCELLED) -> None:
        for r in self.routes:
            r.cancel(why)

    async def aclose(self) -> None:
        if self._responses is not None:
            await self._responses.aclose()

    def __aiter__(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        if self._responses is None:
            self._responses = self._one() if len(self.routes) == 1 else self._many()
        return self._responses

    async def _one(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        async with contextlib.aclosing(self.routes[0]) as responses:
            async for resp in responses:
                yield 0, resp

    async def _many(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        # bounded: a client that reads slowly holds the nodes' streams back (gRPC flow control), as
        # with one prompt, instead of the router buffering every choice's tokens
        out: asyncio.Queue = asyncio.Queue(maxsize=len(self.routes))

        async def pump(prompt: int, routed: Routed) -> None:
            try:
                # closed here, however the pump ends: cancelled while it waits for room in the queue,
                # `routed` is suspended at a response and would stay in flight, its nodes held
                async with contextlib.aclosing(routed) as responses:
                    async for resp in responses:
                        await out.put((prompt, resp))
                await out.put(None)
            except Exception as e:  # (RouteError; anything else ends the answer too, never hangs it)
                await out.put(e)

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(self.routes)]
        try:
            left = len(tasks)
            while left:
                item = await out.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    left -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()  # a routed request still running is cancelled upstream (its consumer went away)
            await asyncio.wait(tasks)  # (each pump closes its routed request: nothing closes it from here)


class HTTPAnswer:
    def __init__(self, routed: Fanout, reply: Reply, stream: bool):
        self.routed, self.reply, self.stream = routed, reply, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            async with contextlib.aclosing(self.routed):
                respond = self._events if self.stream else self._whole
                await respond(aiter(self.routed), scope, receive, send)
        finally:
            watcher.cancel()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # (a body part after the body: none comes)
        self.routed.cancel()  # a no-op once the request ended (the answer went out)

    async def _whole(self, responses: AsyncIterator, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async for prompt, resp in responses:
                # (RouteError past --max-answer-bytes: the 400 below)
                if self.reply.cost(resp, prompt) <= INLINE_RESPONSE_BYTES:
                    self.reply.add(resp, prompt)
                else:
                    await offloaded(self.reply.add, resp, prompt)
            self.reply.check_complete()
        except RouteError as e:
            await error(e.code, e.message)(scope, receive, send)
            return
        pieces = list(self.reply.final())
        self.reply.body = None  # (the pieces hold its text now)
        await _send_pieces(pieces, send)

    async def _events(self, responses: AsyncIterator, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await anext(responses, None)
        except RouteError as e:
            await error(e.code, e.message)(scope, receive, send)
            return
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        unyielded = 0  # bytes of events sent since the loop last ran other tasks
        try:
            if first is not None:
                unyielded += await self._event(send, *first)
            async for prompt, resp in responses:
                unyielded += await self._event(send, prompt, resp)
                if unyielded >= YIELD_BYTES:
                    await asyncio.sleep(0)
                    unyielded = 0
            self.reply.check_complete()
            await _send_event(send, _event_data(self.reply.usage_chunk()))
        except RouteError as e:
            await _send_event(send, _event_data(error_body(e.code, e.message)[1]))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _event(self, send: Send, prompt: int, resp: generation_pb2.GenerateResponse) -> int:
        """Send the event a response makes (none when it carries nothing); returns its bytes."""
        if self.reply.cost(resp, prompt) <= INLINE_RESPONSE_BYTES:
            data = _event_data(self.reply.add(resp, prompt))
        else:
            data = await offloaded(_made_event, self.reply, resp, prompt)
        await _send_event(send, data)
        return len(data)


def _made_event(reply: Reply, resp: generation_pb2.GenerateResponse, prompt: int) -> bytes:
    """(in the worker thread) The event of a large response, its JSON encoded in slices."""
    return _event_data(reply.add(resp, prompt), sliced=True)


def _event_data(obj: dict | None, sliced: bool = False) -> bytes:
    """The server-sent event of a chunk (b"" for None)."""
    if obj is None:
        return b""
    text = "".join(json_pieces(obj)) if sliced else json.dumps(obj)
    return b"data: " + text.encode() + b"\n\n"


async def _send_event(send: Send, data: bytes) -> None:
    if data:
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _send_pieces(pieces: list[str], send: Send) -> None:
    """A 200 JSON answer from the pieces of its text (ASCII), sent SEND_BYTES at a time: never
    joined whole beside them. Consumes `pieces`; after a large answer, the heap it freed goes back."""
    total = sum(map(len, pieces))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(total).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    run, size = [], 0
    for piece in pieces:
        run.append(piece)
        size += len(piece)
        if size >= SEND_BYTES:
            await send({"type": "http.response.body", "body": "".join(run).encode(), "more_body": True})
            run, size = [], 0
    pieces.clear()
    await send({"type": "http.response.body", "body": "".join(run).encode(), "more_body": False})
    if total >= SEND_BYTES:
        release_freed_heap()


def json_response(status: int, obj: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj), status_code=status, headers=headers, media_type="application/json")


def error(code: grpc.StatusCode, message: str, param: str | None = None) -> Response:
    return json_response(*error_body(code, message, param))
