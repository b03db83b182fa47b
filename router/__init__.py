"""The router: kvbridge's front door.

Clients speak gRPC `kvbridge.v1.Generation` or OpenAI-compatible HTTP to it; it picks nodes
(healthy, least outstanding requests) and forwards each request, either to one colocated node
or, disaggregated, to a decode node (streaming) and a prefill node at once, paired by a room.

    config.py       RouterConfig: flags and their defaults
    pool.py         the nodes: health watching, outstanding-request accounting, selection
    checks.py       validation of a GenerateRequest at the door
    dispatch.py     one request's upstream calls: colocated or paired P+D, retries, cancellation
    service.py      gRPC Generation and Admin servicers
    openai_api.py   OpenAI JSON <-> GenerateRequest / GenerateResponse
    http.py         the HTTP server (standard library), SSE streaming
    server.py       start_router(config) -> Router
    cli.py          `kvbridge router`
"""
