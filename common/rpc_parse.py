"""Request messages that do not parse, on every grpc.aio server of kvbridge (common/rpc.py
AioServer): grpcio answers UNKNOWN when a request's deserializer raises (a string field with bad
UTF-8, a truncated field); here the generated adders see a server whose method handlers parse
leniently, so such a call ends INVALID_ARGUMENT with the parser's reason (which names the message
type) before the servicer runs. A request stream's reader checks each message with `rejected`."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError


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


def _checked_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None:
        return handler

    def lenient(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:  # (its message names the type)
            return Unparsed(e)

    if handler.unary_unary is not None:
        method = handler.unary_unary

        async def unary_unary(request, context):
            await rejected(request, context)
            return await method(request, context)

        return handler._replace(request_deserializer=lenient, unary_unary=unary_unary)
    if handler.unary_stream is not None:
        method = handler.unary_stream
        if inspect.isasyncgenfunction(method):

            async def unary_stream(request, context):
                await rejected(request, context)
                async for response in method(request, context):
                    yield response

        else:  # (writes with context.write)

            async def unary_stream(request, context):
                await rejected(request, context)
                return await method(request, context)

        return handler._replace(request_deserializer=lenient, unary_stream=unary_stream)
    return handler._replace(request_deserializer=lenient)  # (request streams: their readers check)


class _ParseChecked:
    """The server as a generated add_*Servicer_to_server sees it: each method's requests are parsed
    leniently (_checked_handler), so a message that does not parse is INVALID_ARGUMENT naming its
    type and the parser's reason, not UNKNOWN."""

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
    """add(servicer, server), the generated adder, with request parsing checked (_ParseChecked)."""
    proxy = _ParseChecked(server)
    add(servicer, proxy)
    proxy.flush()
