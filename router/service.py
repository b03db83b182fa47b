"""The router's gRPC services: Generation (forwarded through the dispatcher) and Admin."""

from __future__ import annotations

import time

import grpc

from kvbridge import __version__
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from router.checks import check_generate
from router.dispatch import Dispatcher, RouteError

SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Admin")


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher

    def Generate(self, request, context):
        try:
            check_generate(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        routed = self.dispatcher.route(request, timeout_s=context.time_remaining())
        context.add_callback(routed.cancel)  # runs when the call ends; cancels upstream if the client left
        try:
            yield from routed
        except RouteError as e:
            context.abort(e.code, e.message)

    def GetModelInfo(self, request, context):
        models = self.dispatcher.pool.models()
        if not models:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy node has reported its model yet")
        info = generation_pb2.ModelInfo()
        info.CopyFrom(models[0])
        info.role = "router"
        return info


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self.started = time.monotonic()

    def GetStatus(self, request, context):
        models = self.dispatcher.pool.models()
        return admin_pb2.Status(
            role="router",
            model_fingerprint=models[0].fingerprint if len(models) == 1 else "",
            queues=self.dispatcher.pool.outstanding(),
            requests_served=self.dispatcher.requests_served,
            version=__version__,
            uptime_s=time.monotonic() - self.started,
        )
