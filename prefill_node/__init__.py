"""The prefill daemon: bootstrap queue, chunked prefill, pushes of every rank's KV to the
decode ranks, inflight queue until every rank's pushes are done.

- `agent.py`: a prefill rank's KV pushes (kv_transfer sender) and its consensus reports
- `loop.py`: rank 0's scheduler loop with the bootstrap and inflight queues
- `service.py`: the Prefill and Bootstrap gRPC services of the front
"""
