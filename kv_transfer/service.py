"""The KVReceiver gRPC service of a decode rank: the thin adapter between kvbridge.v1 messages
and the receiver (kv_transfer/receiver.py). Checks are the room table's; a TransferError
becomes its gRPC status with the message naming the bad value."""

from __future__ import annotations

import grpc

from kv_transfer.rooms import Notice, TransferError
from kvbridge.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


class KVReceiverServicer(kv_transfer_pb2_grpc.KVReceiverServicer):
    def __init__(self, receiver):
        self._receiver = receiver  # a KVReceiverEndpoint

    def WritePages(self, request_iterator, context):
        landed = 0
        try:
            for c in request_iterator:
                landed += self._receiver.write_bytes(
                    c.room, c.secret, c.src_rank, c.layer_start, c.layer_end, list(c.page_ids), c.data
                )
        except TransferError as e:
            context.abort(grpc.StatusCode[e.code], str(e))
        return kv_transfer_pb2.TransferAck(bytes=landed)

    def TransferDone(self, request, context):
        n = request
        first = n.first_token if n.HasField("first_token") else None
        logprob = n.first_logprob if n.HasField("first_logprob") else None
        notice = Notice(n.src_rank, n.layer_start, n.layer_end, n.num_tokens, n.bytes, n.error, first, logprob)
        try:
            self._receiver.rooms.done(notice, n.room, n.secret)
        except TransferError as e:
            context.abort(grpc.StatusCode[e.code], str(e))
        return kv_transfer_pb2.TransferAck(bytes=n.bytes)

    def FirstToken(self, request, context):
        try:
            r = request
            logprob = r.logprob if r.HasField("logprob") else None
            self._receiver.rooms.set_first_token(r.room, r.secret, r.token, r.prompt_tokens, logprob)
        except TransferError as e:
            context.abort(grpc.StatusCode[e.code], str(e))
        return kv_transfer_pb2.TransferAck()
