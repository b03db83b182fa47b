"""What every grpc.aio server of kvbridge (common/rpc.py AioServer) checks at the boundary, in its
method handlers, so that no servicer has to:

- Request messages that do not parse: grpcio answers UNKNOWN when a request's deserializer raises (a
  string field with bad UTF-8, a truncated field); here the generated adders see a server whose
  method handlers parse leniently, so such a call ends INVALID_ARGUMENT with the parser's reason
  (which names the message type) before the servicer runs. A request stream's reader checks each
  message with `rejected`.
- Status messages too long to arrive: each servicer gets its call's context `Bounded`, which clips a
  message it aborts with to MAX_MESSAGE_CHARS (common/shown.py: a longer trailer is dropped and the
  client sees another code), as is grpc's own message for an exception a servicer lets out."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from kvbridge.common.shown import MAX_MESSAGE_CHARS, clipped

KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")  # a method handler's behaviours
log = logging.getLogger("kvbridge.rpc")


class Unparsed:
    """What a request message that does not parse (a string field with bad UTF-8, a truncated
    field) reaches a handler as, instead of grpcio's UNKNOWN: unary calls end INVALID_ARGUMENT
    before the servicer sees them (parse_checked); a stream's reader checks with `rejected`."""

    def __init__(self, error: DecodeError):
        self.why = f"the request does not parse: {error}"


async def rejected(message, context) -> None:
    """End the call INVALID_ARGUMENT when `message` (read from a request stream) is Unparsed."""
    if isinstance(message, Unparsed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.why)


class Bounded:
    """A call's context as its servicer sees it: the same, but a status message it aborts with (or
    sets) is clipped to MAX_MESSAGE_CHARS (common/shown.py): the backstop behind every `shown` value."""

    __slots__ = ("_context",)

    def __init__(self, context):
        self._context = context

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    async def abort(self, code, details: str = "", *args, **kwargs):
        await self._context.abort(code, clipped(details or ""), *args, **kwargs)

    def set_details(self, details: str) -> None:
        self._context.set_details(clipped(details or ""))


async def _unexpected(e: Exception, context) -> None:
    """grpc answers an exception a servicer lets out with UNKNOWN "Unexpected <type>: <message>",
    the message whole; a long one is clipped here (and logged, as grpc would have)."""
    if isinstance(e, grpc.aio.BaseError) or len(str(e)) <= MAX_MESSAGE_CHARS:
        return  # (an abort's own exception; a short message: grpc's answer is bounded)
    log.error("unexpected error in a servicer", exc_info=e)
    await context.abort(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e)}: {e}")


def _checked_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler with its context Bounded and, for a unary request, the request parsed leniently
    (an Unparsed one ends INVALID_ARGUMENT before the servicer runs; request streams: their readers
    check each message)."""
    kind = next(k for k in KINDS if getattr(handler, k) is not None)
    method, unary = getattr(handler, kind), kind.startswith("unary_")
    if inspect.isasyncgenfunction(method):

        async def behavior(request, context):
            context = Bounded(context)
            if unary:
                await rejected(request, context)
            try:
                async for response in method(request, context):
                    yield response
            except Exception as e:
                await _unexpected(e, context)
                raise

    else:  # (a coroutine: a unary answer, or a stream written with context.write)

        async def behavior(request, context):
            context = Bounded(context)
            if unary:
                await rejected(request, context)
            try:
                return await method(request, context)
            except Exception as e:
                await _unexpected(e, context)
                raise

    parse = handler.request_deserializer
    if parse is None:
        return handler._replace(**{kind: behavior})

    def lenient(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:  # (its message names the type)
            return Unparsed(e)

    return handler._replace(request_deserializer=lenient, **{kind: behavior})


class _ParseChecked:
    """The server as a generated add_*Servicer_to_server sees it: each method's handler is checked
    (_checked_handler): a request that does not parse is INVALID_ARGUMENT naming its type and the
    parser's reason, not UNKNOWN, and a status message is clipped."""

    def __init__(self, server):
        self._server = server
        self._generic: list = []  # (superseded by the registered handlers, which come next)

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        checked = {name: _checked_handler(h) for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, checked),))
        self._server.add_registered_method_handlers(service, checked)
        self._generic.clear()

    def flush(self) -> None:
        if self._generic:  # (code generated without registered handlers: added unchecked)
            self._server.add_generic_rpc_handlers(tuple(self._generic))


def parse_checked(add: Callable, servicer, server) -> None:
    """add(servicer, server), the generated adder, with its handlers checked (_ParseChecked)."""
    proxy = _ParseChecked(server)
    add(servicer, proxy)
    proxy.flush()
