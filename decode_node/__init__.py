"""The decode daemon: layout check, prealloc queue, registration with the prefill node,
transfer queue, then the transferred requests join continuous-batching decode.

- `agent.py`: a decode rank's receiver (kv_transfer) and its consensus reports
- `loop.py`: rank 0's scheduler loop with the prealloc and transfer queues
- `service.py`: the Generation gRPC service of the front (the router's half of a request)
"""
