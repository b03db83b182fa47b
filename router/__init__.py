"""The router: kvbridge's front door, on one asyncio event loop (no thread per request or connection).

Clients speak gRPC `kvbridge.v1.Generation` or OpenAI-compatible HTTP to it; it picks healthy
nodes by a policy (by default cache_aware: the node holding most of the prompt's prefix, known from
the nodes' KV events, unless the load is imbalanced) and forwards each request, either to one colocated node
or, disaggregated, to a decode node (streaming) and a prefill node at once, paired by a room.
A request whose node fails before its first token reached the client is retried on other nodes
(bounded attempts, backoff); the router's own timeouts end attempts without a first token and
streams gone quiet. When a node dies, the requests on it are retried or failed within 1 s if its
process died (its sockets close: kill -9, a crash), and within first_token_timeout_s /
idle_stream_timeout_s if its host went silent (dispatch.py says why).

    config.py       RouterConfig: flags and their defaults
    pool.py         the nodes: health and KV-event watching, outstanding-request accounting, selection,
                    add/remove
    kv_index.py     BlockIndex: the blocks one node's prefix cache holds, from its KV events
    policy.py       Policy: cache_aware, least_loaded, round_robin; which eligible node and why
    prompts.py      a request's block hashes, with the tokenizer fetched from the nodes
    checks.py       validation of a GenerateRequest at the door
    dispatch.py     one request's upstream calls: colocated or paired P+D, retries, timeouts,
                    cancellation; the requests in flight, draining, a log line per phase; how soon
                    the requests on a dead node end
    metrics.py      the router's Prometheus registry: latencies, outcomes, retries, timeouts, node gauges
    service.py      gRPC Generation and Admin servicers (status, requests, abort, drain, config, fleet,
                    ClearPrefixCache)
    openai_api.py   OpenAI JSON <-> GenerateRequest / GenerateResponse
    http.py         the HTTP server (Starlette on uvicorn): limits, timeouts, SSE streaming
    connection.py   one HTTP connection: header timeout, body limit, refusals (then read out and closed)
    worker.py       one worker thread for large bodies and large answer parts, off the loop
    server.py       start_router(config) -> Router
    cli.py          `kvbridge router`
"""
