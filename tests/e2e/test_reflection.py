"""A client that knows nothing but server reflection: no generated stubs, no kvbridge import.
It runs in a separate interpreter, builds every type from the server's descriptors, lists the
services and calls Admin.GetStatus and Generation.Generate."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CLIENT = textwrap.dedent(
    """
    import json, sys
    import grpc
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert not any(m.startswith(("kvbridge", "engine", "router")) for m in sys.modules)
    channel = grpc.insecure_channel(sys.argv[1])
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    services = sorted(db.get_services())

    def call(service, method, fields, stream=False):
        m = pool.FindServiceByName(service).FindMethodByName(method)
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        kind = channel.unary_stream if stream else channel.unary_unary
        rpc = kind(f"/{service}/{method}", request_serializer=req_cls.SerializeToString,
                   response_deserializer=resp_cls.FromString)
        req = json_format.ParseDict(fields, req_cls())
        out = rpc(req, timeout=30)
        as_dict = lambda r: json_format.MessageToDict(r, preserving_proto_field_name=True)
        return [as_dict(r) for r in out] if stream else as_dict(out)

    status = call("kvbridge.v1.Admin", "GetStatus", {})
    gen = call("kvbridge.v1.Generation", "Generate",
               {"prompt": {"token_ids": {"ids": [1, 2, 3]}}, "sampling": {"max_new_tokens": 4, "ignore_eos": True}},
               stream=True)
    print(json.dumps({"services": services, "status": status, "tokens": sum(len(r.get("token_ids", [])) for r in gen)}))
    """
)


def test_a_reflection_only_client_lists_services_and_calls_admin_and_generation(colocated_node):
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, colocated_node.address], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["services"] == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "kvbridge.v1.Admin",
        "kvbridge.v1.Generation",
        "kvbridge.v1.KVEvents",
    ]
    status = result["status"]
    assert (status["role"], status["model"], status["pp_size"], status["serving"]) == (
        "colocated",
        "tiny-random",
        1,
        True,
    )
    assert status["ranks"] == [{"alive": True, "kv_pages_total": 1024}]  # zeros (rank 0, 0 used) are omitted in JSON
    assert set(status["queues"]) == {"waiting", "running", "forked", "inflight_microbatches"}
    assert result["tokens"] == 4
