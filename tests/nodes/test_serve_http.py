"""One process, one command: `kvbridge serve --http-port` serves the OpenAI-compatible HTTP API and
GET /health from the colocated node's own front process (as llama-server and vLLM do, and as a pod
behind an InferencePool must): the engine's tokens, the API key, and no listener besides the
node's gRPC port and the HTTP port."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from kvbridge.common.sampling import SamplingParams
from tests.conftest import make_llm, make_prompts
from tests.nodes.test_listeners import listening_sockets

KEY = "sk-serve-http-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api.key"
    key_file.write_text(KEY + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "serve", "--model", "tiny-random", "--dtype", "float32", "--page-size", "4",
         "--port", "0", "--http-port", "0", "--api-key-file", str(key_file), "--quiet"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not (line := proc.stderr.readline()).startswith("kvbridge serve: listening on "):
            assert line, "kvbridge serve exited before it was ready"
        grpc_addr, http = line.split("listening on ")[1].split(", http on ")
        yield proc, grpc_addr.strip(), http.split(",")[0].strip()
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def request(http: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{http}{path}", data, headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_completions_from_the_nodes_own_process_equal_the_engine(served, tiny_model):
    _, _, http = served
    prompt = make_prompts(1, tiny_model.config.vocab_size, seed=9)[0]
    want = make_llm(tiny_model).generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    status, answer = request(http, "/v1/completions", body)
    assert status == 200, answer
    n = len(prompt)
    usage = {"prompt_tokens": n, "completion_tokens": 6, "total_tokens": n + 6}
    assert answer["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
    [choice] = answer["choices"]
    assert (choice["text"], choice["finish_reason"]) == (tiny_model.tokenizer.decode(want.output_ids), "length")
    assert request(http, "/v1/models")[1]["data"][0]["id"] == "tiny-random"


def test_health_and_the_api_key(served):
    _, _, http = served
    assert urllib.request.urlopen(f"http://{http}/health", timeout=10).status == 200
    status, answer = request(http, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1}, key="wrong")
    assert (status, answer["error"]["code"]) == (401, "invalid_api_key")


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_sent_whole_gets_its_413(served, chunked):
    """7.6 MB, all sent before the answer is read (http.client does so): the connection used to be
    closed under it, the 413 lost to a reset."""
    _, _, address = served
    body = json.dumps({"prompt": "x" * 7_600_000}).encode()
    parts = (body[i : i + (1 << 16)] for i in range(0, len(body), 1 << 16))
    conn = http.client.HTTPConnection(address, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    try:
        conn.request("POST", "/v1/completions", parts if chunked else body, headers, encode_chunked=chunked)
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())["error"]["message"]) == (413, "body over 4194304 bytes")
    finally:
        conn.close()


def test_the_front_process_listens_on_the_grpc_and_http_ports_only(served):
    proc, grpc_addr, http = served
    ports = sorted(port for _, _, port in listening_sockets({"serve": proc.pid}))
    assert ports == sorted([int(grpc_addr.rsplit(":", 1)[1]), int(http.rsplit(":", 1)[1])])
