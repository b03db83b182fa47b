"""A fleet with mutual TLS and keys (issue 11), as `kvbridge` processes with certificates made
here (trustme): a router, a prefill node and a decode node (pp 2 each, KV over the grpc engine,
/metrics on). Chats go through the openai client over HTTPS; every port refuses plaintext,
certificate-less and foreign-CA clients; the API key guards Generation and HTTP, the admin key
guards Admin on every process; neither key shows in logs or GetConfig."""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import trustme

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.common.security import Security, auth_metadata
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import make_llm
from tests.e2e.test_load import KVBRIDGE, Process, process_tree, stop_all
from tests.nodes.test_listeners import LOOPBACK, listening_sockets

API_KEY, ADMIN_KEY = "sk-test-4f1c9e2a7b", "admin-test-0d8e3b61"
PROMPT = list(range(7, 40))
MAX_NEW = 6
QUESTION = [{"role": "user", "content": "What do bees make?"}]
# no key, and a wrong one
REFUSALS = (((), grpc.StatusCode.UNAUTHENTICATED), (auth_metadata("sk-other"), grpc.StatusCode.PERMISSION_DENIED))


@dataclass(frozen=True)
class Certs:
    ca: str  # the fleet's CA (PEM)
    cert: str  # a certificate it signed for 127.0.0.1 and localhost, and its key: every process and client
    key: str
    foreign_cert: str  # signed by another CA, with its key
    foreign_key: str
    api_key_file: str
    admin_key_file: str
    fleet_key_file: str  # every process's --fleet-key-file (not the default file this test process has)

    def flags(self) -> tuple[str, ...]:
        return ("--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca)

    def client(self, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
        """An HTTPS client trusting the fleet's CA, presenting `cert` (the fleet's by default)."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if cert != "":
            ctx.load_cert_chain(cert or self.cert, key or self.key)
        return ctx


def write_leaf(ca: trustme.CA, where: Path, name: str) -> tuple[str, str]:
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    for i, pem in enumerate(leaf.cert_chain_pems):
        pem.write_to_path(cert, append=i > 0)
    leaf.private_key_pem.write_to_path(key)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    where = tmp_path_factory.mktemp("tls")
    ca, foreign = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(where / "ca.pem")
    cert, key = write_leaf(ca, where, "fleet")
    foreign_cert, foreign_key = write_leaf(foreign, where, "foreign")
    (where / "api.key").write_text(API_KEY + "\n")
    (where / "admin.key").write_text(ADMIN_KEY + "\n")
    (where / "fleet-key.txt").write_text(secrets.token_hex(32) + "\n")
    return Certs(str(where / "ca.pem"), cert, key, foreign_cert, foreign_key, str(where / "api.key"),
                 str(where / "admin.key"), str(where / "fleet-key.txt"))  # fmt: skip


NODE = ("--model", "tiny-random", "--port", "0", "--pp-size", "2", "--metrics-port", "0", "--log-level", "info")


@pytest.fixture(scope="module")
def fleet(certs):
    secure = (*certs.flags(), "--admin-key-file", certs.admin_key_file, "--fleet-key-file", certs.fleet_key_file)
    started: list[Process] = []
    try:
        prefill = Process("prefill", "prefill", *NODE, "--transfer-backend", "grpc", *secure)
        decode = Process("decode", "decode", *NODE, "--transfer-backend", "grpc", *secure)
        started += [prefill, decode]
        prefill.wait_ready()
        decode.wait_ready()
        router = Process("router", "router", "--prefill", prefill.address, "--decode", decode.address,
                         "--port", "0", "--http-port", "0", "--metrics-port", "0", *secure,
                         "--api-key-file", certs.api_key_file)  # fmt: skip
        started.append(router)
        router.wait_ready()
        yield {"prefill": prefill, "decode": decode, "router": router}
    finally:
        stop_all(started)


@pytest.fixture
def tls_client(certs):
    """This test process's channels present the fleet's certificate (and plaintext again after)."""
    rpc.configure(Security(cert_file=certs.cert, key_file=certs.key, ca_file=certs.ca))
    yield
    rpc.configure(Security())


def reference_ids(tiny_model, prompt: list[int]) -> list[int]:
    llm = make_llm(tiny_model, chunked_prefill_size=0)
    [c] = llm.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    return c.output_ids


def generate(addr: str | grpc.Channel, metadata=()) -> list[int]:
    """PROMPT's tokens from Generation at `addr` (a channel this test process's Security makes), or on `channel`."""
    req = generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=PROMPT)),
        sampling=common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
    )
    channel = rpc.make_channel(addr) if isinstance(addr, str) else addr
    stub = generation_pb2_grpc.GenerationStub(channel)
    return [t for r in stub.Generate(req, timeout=60, metadata=metadata) for t in r.token_ids]


def test_the_openai_client_over_https_gets_the_reference_chat(fleet, certs, tiny_model):
    llm = make_llm(tiny_model, chunked_prefill_size=0)
    tok = llm.model.tokenizer
    [ref] = llm.generate([tok.encode(tok.apply_chat_template(QUESTION))], SamplingParams(max_new_tokens=MAX_NEW))
    client = openai.OpenAI(
        base_url=f"https://127.0.0.1:{fleet['router'].http_port}/v1", api_key=API_KEY,
        http_client=httpx.Client(verify=certs.client()), max_retries=0,
    )  # fmt: skip
    for _ in range(2):
        answer = client.chat.completions.create(model="tiny-random", messages=QUESTION, max_tokens=MAX_NEW,
                                                temperature=0)  # fmt: skip
        assert answer.choices[0].message.content == ref.text
        assert answer.usage.completion_tokens == len(ref.output_ids)
    stream = client.chat.completions.create(model="tiny-random", messages=QUESTION, max_tokens=MAX_NEW,
                                            temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text


def test_grpc_generation_over_mtls_with_the_api_key_gets_the_reference_tokens(fleet, tls_client, tiny_model):
    assert generate(fleet["router"].address, auth_metadata(API_KEY)) == reference_ids(tiny_model, PROMPT)


def test_a_missing_or_wrong_api_key_is_401_on_http_and_refused_on_grpc(fleet, certs, tls_client):
    url = f"https://127.0.0.1:{fleet['router'].http_port}/v1/chat/completions"
    body = {"model": "tiny-random", "messages": QUESTION, "max_tokens": 2}
    with httpx.Client(verify=certs.client()) as http:
        for headers, message in (({}, "missing API key"), ({"Authorization": "Bearer sk-other"}, "wrong API key")):
            resp = http.post(url, json=body, headers=headers)
            assert resp.status_code == 401
            error = resp.json()["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
            assert error["message"].startswith(message) and resp.headers["www-authenticate"] == "Bearer"
        assert http.get(f"https://127.0.0.1:{fleet['router'].http_port}/health").status_code == 200  # probes stay open
    for metadata, code in REFUSALS:
        with pytest.raises(grpc.RpcError) as e:
            generate(fleet["router"].address, metadata)
        assert e.value.code() == code


def admin_status(addr: str, metadata=()) -> admin_pb2.Status:
    return admin_pb2_grpc.AdminStub(rpc.make_channel(addr)).GetStatus(
        admin_pb2.GetStatusRequest(), timeout=10, metadata=metadata
    )


def test_admin_needs_the_admin_key_on_every_process(fleet, certs, tls_client):
    for name, process in fleet.items():
        for metadata, code in REFUSALS:
            with pytest.raises(grpc.RpcError) as e:
                admin_status(process.address, metadata)
            assert e.value.code() == code, name
        assert admin_status(process.address, auth_metadata(ADMIN_KEY)).role == ("router" if name == "router" else name)
        # the command-line client, with and without the key
        cli = [KVBRIDGE, "admin", "config", "--target", process.address, *certs.flags(), "--json"]
        ok = subprocess.run([*cli, "--key-file", certs.admin_key_file], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert API_KEY not in ok.stdout and ADMIN_KEY not in ok.stdout and json.loads(ok.stdout)
        refused = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    for process in fleet.values():
        assert not any(API_KEY in line or ADMIN_KEY in line for line in process.lines)


def handshake(port: int, ctx: ssl.SSLContext | None, probe: bytes, connect_s: float = 10) -> bytes | None:
    """What the server answers to `probe` sent over TLS with `ctx` (plaintext when None): its first
    bytes; b"" when it closed the connection; None when it kept it open for a second without a word
    (a gRPC server waiting for more). An ssl.SSLError (a refused handshake) propagates."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=connect_s)
    if ctx is not None:
        ctx.set_alpn_protocols(["h2"] if probe.startswith(b"PRI") else ["http/1.1"])  # (gRPC insists on h2)
    with ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx else raw as conn:
        conn.sendall(probe)
        conn.settimeout(1.0)
        try:
            return conn.recv(64)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return b""


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # preface + empty SETTINGS
HTTP_GET = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def refused(port: int, ctx: ssl.SSLContext | None) -> bool:
    """The port talked to this client in neither protocol (HTTP/2 for gRPC, HTTP/1.1): each time a
    failed handshake, or the connection closed without an answer (a TLS 1.3 server checks a client
    certificate after the client's side of the handshake ended), or only a TLS alert in plaintext."""

    def no_answer(probe: bytes) -> bool:
        try:
            answer = handshake(port, ctx, probe)
        except (ssl.SSLError, BrokenPipeError, ConnectionResetError):
            return True
        return answer == b"" or (ctx is None and answer[:1] == b"\x15")  # (0x15: a TLS alert record)

    return no_answer(H2_PREFACE) and no_answer(HTTP_GET)


def test_every_port_refuses_plaintext_certificate_less_and_foreign_clients(fleet, certs):
    pids = process_tree({name: p.proc.pid for name, p in fleet.items()})
    sockets = listening_sockets(pids)
    right, none, foreign = certs.client(), certs.client(cert=""), certs.client(certs.foreign_cert, certs.foreign_key)
    tls_ports, inter_rank = {}, []

    def talks(port: int) -> bool:
        try:
            handshake(port, right, H2_PREFACE, connect_s=2)
            return True
        except (ssl.SSLError, ConnectionError, TimeoutError):  # (a TCPStore never answers a ClientHello)
            return False

    assert all(host in LOOPBACK for _, host, _ in sockets), sockets
    with concurrent.futures.ThreadPoolExecutor(len(sockets)) as pool:  # (the silent ones time out together)
        answers = list(pool.map(talks, [port for _, _, port in sockets]))
    for (label, _, port), tls in zip(sockets, answers):
        if tls:
            tls_ports[port] = label
        else:
            inter_rank.append((label, port))
    # every kvbridge server speaks TLS: each front's gRPC and /metrics, the router's HTTP, and the
    # KV receiver of each decode rank; what does not is torch.distributed among a node's own ranks
    # (its rendezvous store and gloo pairs: loopback here, a private network across hosts)
    fronts = {"prefill": 2, "decode": 2, "router": 3}
    for name, count in fronts.items():
        assert sorted(label for label in tls_ports.values() if label == name) == [name] * count
    assert sorted(label for label in tls_ports.values() if label.startswith("decode/rank")) == [
        "decode/rank",
        "decode/rank2",
    ]
    assert all("/rank" in label for label, _ in inter_rank), inter_rank
    for port, label in tls_ports.items():
        assert not refused(port, right), f"{label} port {port} refused the fleet's own certificate"
        assert refused(port, None), f"{label} port {port} answered plaintext"
        assert refused(port, none), f"{label} port {port} took a client without a certificate"
        assert refused(port, foreign), f"{label} port {port} took a certificate of another CA"
    for process in fleet.values():  # and with the fleet's certificate, /metrics answers over HTTPS
        resp = httpx.get(process.metrics_url.replace("http://", "https://"), verify=right)
        assert resp.status_code == 200 and "kvbridge_" in resp.text


# ---------------------------------------------------------------- client-facing ports (--client-cert-reqs)


@pytest.fixture(scope="module")
def public_routers(fleet, certs):
    """policy -> a router in front of the fleet's nodes whose HTTP API and gRPC Generation take
    clients as --client-cert-reqs says (none, optional), with the API key and Admin on a port of
    its own. (The fleet's own router keeps the default, required.)"""
    secure = (*certs.flags(), "--admin-key-file", certs.admin_key_file, "--api-key-file", certs.api_key_file,
              "--fleet-key-file", certs.fleet_key_file)  # fmt: skip
    nodes = ("--prefill", fleet["prefill"].address, "--decode", fleet["decode"].address)
    routers: dict[str, Process] = {}
    try:
        for policy in ("none", "optional"):
            routers[policy] = Process(f"router_{policy}", "router", *nodes, "--port", "0", "--http-port", "0",
                                      "--admin-port", "0", "--client-cert-reqs", policy, *secure)  # fmt: skip
        for router in routers.values():
            router.wait_ready()
        yield routers
    finally:
        stop_all(list(routers.values()))


def admin_address(router: Process) -> str:
    """The router's --admin-port address, from the line it prints before its ready line."""
    [line] = [line for line in router.lines if line.startswith("kvbridge router: admin on ")]
    return line.split()[-1]


def port_of(addr: str) -> int:
    return int(addr.rpartition(":")[2])


def certless_channel(certs: Certs, addr: str) -> grpc.Channel:
    """A TLS channel trusting the fleet's CA and presenting no certificate."""
    creds = grpc.ssl_channel_credentials(root_certificates=Path(certs.ca).read_bytes())
    return grpc.secure_channel(addr, creds, options=rpc.channel_options())


@pytest.mark.parametrize("policy", ["none", "optional"])
def test_a_router_taking_clients_without_a_certificate_serves_them_with_the_api_key_and_keeps_admin_mutual(
    public_routers, fleet, certs, tls_client, tiny_model, policy
):
    router = public_routers[policy]
    llm = make_llm(tiny_model, chunked_prefill_size=0)
    tok = llm.model.tokenizer
    [ref] = llm.generate([tok.encode(tok.apply_chat_template(QUESTION))], SamplingParams(max_new_tokens=MAX_NEW))
    base = f"https://127.0.0.1:{router.http_port}/v1"
    with httpx.Client(verify=certs.client(cert="")) as http:  # TLS, no client certificate
        client = openai.OpenAI(base_url=base, api_key=API_KEY, http_client=http, max_retries=0)
        answer = client.chat.completions.create(model="tiny-random", messages=QUESTION, max_tokens=MAX_NEW,
                                                temperature=0)  # fmt: skip
        assert answer.choices[0].message.content == ref.text
        body = {"model": "tiny-random", "messages": QUESTION, "max_tokens": 2}
        assert http.post(f"{base}/chat/completions", json=body).status_code == 401  # the API key still guards it
    channel = certless_channel(certs, router.address)
    assert generate(channel, auth_metadata(API_KEY)) == reference_ids(tiny_model, PROMPT)
    with pytest.raises(grpc.RpcError) as e:
        generate(channel)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Admin is not on the client-facing port; its own port keeps mutual TLS and the admin key
    admin_stub = admin_pb2_grpc.AdminStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        admin_stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10, metadata=auth_metadata(ADMIN_KEY))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    admin = admin_address(router)
    assert refused(port_of(admin), certs.client(cert=""))
    assert refused(port_of(admin), certs.client(certs.foreign_cert, certs.foreign_key))
    assert admin_status(admin, auth_metadata(ADMIN_KEY)).role == "router"
    for metadata, code in REFUSALS:
        with pytest.raises(grpc.RpcError) as e:
            admin_status(admin, metadata)
        assert e.value.code() == code
    # the fleet's own ports still refuse the same client
    for name in ("prefill", "decode"):
        assert refused(port_of(fleet[name].address), certs.client(cert="")), name


def test_optional_client_certificates_are_checked_on_http_when_presented(public_routers, certs):
    optional, none = public_routers["optional"], public_routers["none"]
    foreign = (certs.foreign_cert, certs.foreign_key)
    assert not refused(optional.http_port, certs.client())
    assert not refused(optional.http_port, certs.client(cert=""))
    assert refused(optional.http_port, certs.client(*foreign))  # presented, and not signed by the fleet's CA
    assert not refused(none.http_port, certs.client(*foreign))  # not asked for: never sent, never checked
    # grpcio can require a certificate or ask for none: the gRPC port under optional asks for none
    assert not refused(port_of(optional.address), certs.client(*foreign))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--client-cert-reqs", "none", "--admin-port", "0"),
         "--client-cert-reqs none takes clients without a certificate: give --api-key-file, which they must send"),
        (("--client-cert-reqs", "optional", "--api-key-file", "API_KEY_FILE"),
         "--client-cert-reqs optional takes clients without a certificate on --port, where Admin is served: give "
         "--admin-port (Admin keeps mutual TLS there)"),
    ],
)  # fmt: skip
def test_a_router_refuses_to_take_clients_without_a_certificate_unauthenticated_or_beside_admin(certs, flags, message):
    flags = tuple(certs.api_key_file if f == "API_KEY_FILE" else f for f in flags)
    out = subprocess.run([KVBRIDGE, "router", "--port", "0", "--http-port", "0", *certs.flags(), *flags],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (out.returncode, out.stderr) == (2, f"kvbridge router: error: {message}\n")


def test_the_demo_runs_its_whole_fleet_under_mtls(certs):
    out = subprocess.run(
        [KVBRIDGE, "demo", "--model", "tiny-random", "--prefill-pp", "1", "--decode-pp", "1", "--requests", "2",
         "--max-new-tokens", "4", "--json", *certs.flags()],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])["summary"]
    assert (summary["requests"], summary["output_tokens"]) == (2, 8)


def test_a_colocated_node_serves_over_mtls_and_refuses_plaintext(certs, tls_client, tiny_model):
    node = Process("colocated", "serve", *NODE, *certs.flags(), "--admin-key-file", certs.admin_key_file)
    try:
        node.wait_ready()
        assert generate(node.address) == reference_ids(tiny_model, PROMPT)  # node-direct: no API key there
        assert admin_status(node.address, auth_metadata(ADMIN_KEY)).role == "colocated"
        rpc.configure(Security())  # a plaintext client
        with pytest.raises(grpc.RpcError) as e:
            generate(node.address)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        node.stop()
