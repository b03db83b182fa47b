"""Generated protobuf and gRPC code (scripts/gen_proto.py); import only from thin adapters."""
