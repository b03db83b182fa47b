"""deploy/k8s/ and the Dockerfile, checked without a cluster or a Docker daemon: every core
manifest against Kubernetes' own schemas (kubernetes-validate, strict), the LeaderWorkerSet and
ServiceMonitor against the CRD schemas vendored in deploy/k8s/schemas/, every probe against what
the processes serve (gRPC health on their --port), every port against the args, every flag
against the project's own argparse, and the Dockerfile's variants, set-up and entrypoint."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from kvbridge.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
K8S_VERSION = "1.30.0"  # the oldest release whose native gRPC probes are GA (1.27) and still listed
CRD_SCHEMAS = {"LeaderWorkerSet": "leaderworkerset.json", "ServiceMonitor": "servicemonitor.json"}
WORKLOADS = ("StatefulSet", "Deployment", "LeaderWorkerSet")
ROLES = ("prefill", "decode", "router")


def _docs() -> list[tuple[str, dict]]:
    """The manifests of deploy/k8s/ and extras/ (gateway/ is tests/e2e/test_deploy_gateway.py's)."""
    out = []
    for path in sorted([*K8S.glob("*.yaml"), *(K8S / "extras").glob("*.yaml")]):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((str(path.relative_to(ROOT)), doc))
    return out


DOCS = _docs()


def _id(item: tuple[str, dict]) -> str:
    path, doc = item
    return f"{path}:{doc['kind']}/{doc['metadata']['name']}"


LWS_NAME, LWS_INDEX = "leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/worker-index"


def _pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [doc["spec"]["template"]]


def _pod_labels(doc: dict, i: int) -> dict:
    """The labels of template i's pods: the LWS controller adds its own (the leader's index is 0)."""
    labels = dict(_pod_templates(doc)[i]["metadata"]["labels"])
    if doc["kind"] == "LeaderWorkerSet":
        labels |= {LWS_NAME: doc["metadata"]["name"], LWS_INDEX: "0" if i == 0 else "1"}
    return labels


def _containers() -> list[tuple[str, dict, dict]]:
    """(where, pod template with its pods' labels, container) of every kvbridge container."""
    out = []
    for path, doc in DOCS:
        if doc["kind"] in WORKLOADS:
            for i, tpl in enumerate(_pod_templates(doc)):
                tpl = {**tpl, "metadata": {**tpl["metadata"], "labels": _pod_labels(doc, i)}}
                for c in tpl["spec"]["containers"]:
                    out.append((f"{path}:{doc['kind']}/{doc['metadata']['name']}[{i}]/{c['name']}", tpl, c))
    return out


CONTAINERS = _containers()


def _flag_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} must appear once in {args}"
    return args[args.index(flag) + 1]


def test_manifests_found():
    kinds = {doc["kind"] for _, doc in DOCS}
    assert {"Namespace", "Service", "StatefulSet", "Deployment", "PodDisruptionBudget", "ConfigMap"} <= kinds
    assert {"LeaderWorkerSet", "ServiceMonitor"} <= kinds
    roles = {c["args"][0] for _, _, c in CONTAINERS}
    assert roles == set(ROLES)
    assert all(doc["metadata"].get("namespace", "kvbridge") == "kvbridge" for _, doc in DOCS)
    assert all(doc["metadata"]["name"] == "kvbridge" for _, doc in DOCS if doc["kind"] == "Namespace")


@pytest.mark.parametrize("item", [d for d in DOCS if d[1]["kind"] not in CRD_SCHEMAS], ids=_id)
def test_core_manifest_validates_strictly(item):
    _, doc = item
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("item", [d for d in DOCS if d[1]["kind"] in CRD_SCHEMAS], ids=_id)
def test_crd_manifest_validates_against_vendored_schema(item):
    _, doc = item
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[doc["kind"]]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("item", [d for d in DOCS if d[1]["kind"] == "LeaderWorkerSet"], ids=_id)
def test_lws_pod_templates_are_core_pod_templates(item):
    """The vendored LWS schema trims the pod templates; Kubernetes' own schema checks them whole."""
    _, doc = item
    for tpl in _pod_templates(doc):
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl}
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)


def test_vendored_schemas_reject_broken_documents():
    lws = next(doc for _, doc in DOCS if doc["kind"] == "LeaderWorkerSet")
    schema = json.loads((SCHEMAS / "leaderworkerset.json").read_text())
    broken = json.loads(json.dumps(lws))
    broken["spec"]["leaderWorkerTemplate"]["size"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    del broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def check_probes(where: str, container: dict) -> int:
    """The container's probes are gRPC health on its --port (startup too, for a node) and TCP liveness
    there; returns the port."""
    args = container["args"]
    port = int(_flag_value(args, "--port"))
    assert container["readinessProbe"]["grpc"] == {"port": port}, where
    assert container["livenessProbe"]["tcpSocket"] == {"port": port}, where
    if args[0] != "router":
        assert container["startupProbe"]["grpc"] == {"port": port}, where
    return port


@pytest.mark.parametrize("where,tpl,container", CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_probes_are_the_served_grpc_health(where, tpl, container):
    """Every process serves grpc.health.v1 (service "") on its --port: readiness (and the nodes'
    startup, NOT_SERVING while loading) is Kubernetes' native gRPC probe there. Liveness is a TCP
    check of the same port: NOT_SERVING also means draining (nodes) or no routable node (router),
    which a restart would not cure, and a node whose rank died exits 1 by itself."""
    check_probes(where, container)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in container:
            assert "httpGet" not in container[probe] and "exec" not in container[probe], where


@pytest.mark.parametrize("where,tpl,container", CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_ports_match_args_and_services(where, tpl, container):
    args = container["args"]
    declared = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"grpc": int(_flag_value(args, "--port")), "metrics": int(_flag_value(args, "--metrics-port"))}
    if args[0] == "router":
        expected["http"] = int(_flag_value(args, "--http-port"))
    if "--dist-init-addr" in args and _flag_value(args, "--host-rank") == "0":
        expected["dist"] = int(_flag_value(args, "--dist-init-addr").rsplit(":", 1)[1])
    assert declared == expected, where
    labels = tpl["metadata"]["labels"]
    services = [
        doc
        for _, doc in DOCS
        if doc["kind"] == "Service" and all(labels.get(k) == v for k, v in doc["spec"]["selector"].items())
    ]
    if "--host-rank" in args and _flag_value(args, "--host-rank") != "0":
        assert not services, f"{where}: a worker host serves no node of its own"
        return
    assert len(services) == 1, where
    for port in services[0]["spec"]["ports"]:
        assert port["targetPort"] in declared, where
        assert port["port"] == declared[port["targetPort"]], where


def test_router_discovers_the_headless_services():
    headless = {
        (doc["metadata"]["name"], p["port"])
        for _, doc in DOCS
        if doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None"
        for p in doc["spec"]["ports"]
        if p["name"] == "grpc"
    }
    (router,) = [c for _, _, c in CONTAINERS if c["args"][0] == "router"]
    args = router["args"]
    found = {}
    for item in _flag_value(args, "--discover").split(","):  # once: a second --discover replaces the first
        role, _, target = item.partition("=")
        host, _, port = target.rpartition(":")
        name, namespace, *rest = host.split(".")
        assert namespace == "kvbridge" and rest == ["svc", "cluster", "local"], target
        assert (name, int(port)) in headless, target
        found[role] = name
    assert found == {"prefill": "kvbridge-prefill", "decode": "kvbridge-decode"}


def _router_has_discover() -> bool:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return any("--discover" in a.option_strings for a in sub.choices["router"]._actions)


@pytest.mark.parametrize("where,tpl,container", CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_flag_exists(where, tpl, container):
    """The args parse with the project's own parser. `--discover` is being added to the router
    (issue 14); until it exists it is the only flag left unchecked, and once it does, its value
    must parse into the router's config."""
    args = list(container["args"])
    if args[0] == "router" and not _router_has_discover():
        args = [a for i, a in enumerate(args) if a != "--discover" and (i == 0 or args[i - 1] != "--discover")]
    ns, unknown = build_parser().parse_known_args(args)
    assert not unknown, f"{where}: unknown arguments {unknown}"
    assert ns.command == container["args"][0]
    if ns.command == "router" and _router_has_discover():
        from kvbridge.router.cli import config_from_args

        config = config_from_args(ns)  # validates every --discover target
        assert sorted(t.partition("=")[0] for t in config.discover) == ["decode", "prefill"], where
    if ns.command != "router":
        from kvbridge.common.flags import from_flags
        from kvbridge.engine.config import PPConfig

        pp = from_flags(PPConfig, ns)  # validates --pp-size / --num-hosts / --host-rank / --dist-init-addr
        assert ns.host in ("0.0.0.0", "$(POD_IP)"), where
        if pp.num_hosts > 1:
            assert ns.dist_init_addr.startswith("$(LWS_LEADER_ADDRESS):"), where


def test_decode_binds_its_pod_ip():
    """A decode rank announces --host:port of its KVReceiver to prefill nodes: 0.0.0.0 is not dialable."""
    for where, _, c in CONTAINERS:
        if c["args"][0] == "decode":
            assert _flag_value(c["args"], "--host") == "$(POD_IP)", where
            (env,) = [e for e in c["env"] if e["name"] == "POD_IP"]
            assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where


def test_lws_hosts_are_consistent():
    (lws,) = [doc for _, doc in DOCS if doc["kind"] == "LeaderWorkerSet"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    ranks = []
    for tpl in _pod_templates(lws):
        (c,) = tpl["spec"]["containers"]
        assert int(_flag_value(c["args"], "--num-hosts")) == size
        assert int(_flag_value(c["args"], "--pp-size")) % size == 0
        ranks.append(int(_flag_value(c["args"], "--host-rank")))
    assert ranks == [0, 1]


@pytest.mark.parametrize("where,tpl,container", CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_resources_tls_mount_and_pdb(where, tpl, container):
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), where
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys(), where
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    assert mount["mountPath"] == "/etc/kvbridge/tls" and mount["readOnly"], where
    (vol,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "tls"]
    assert vol["secret"]["secretName"] == "kvbridge-tls", where
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):  # TLS on: all three, from the Secret
        if flag in container["args"]:
            assert _flag_value(container["args"], flag).startswith("/etc/kvbridge/tls/"), where
    labels = tpl["metadata"]["labels"]
    pdbs = [
        doc
        for _, doc in DOCS
        if doc["kind"] == "PodDisruptionBudget"
        and all(labels.get(k) == v for k, v in doc["spec"]["selector"]["matchLabels"].items())
    ]
    assert len(pdbs) == 1, where


@pytest.mark.parametrize("where,tpl,container", CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_process_reads_the_fleet_key_from_one_required_secret(where, tpl, container):
    """Pods have filesystems of their own: without one key for all (SECURITY.md), each process
    would make its own default key, and no decode node would trust a prefill node or a route."""
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "fleet"]
    assert mount["mountPath"] == "/etc/kvbridge/fleet" and mount["readOnly"], where
    assert _flag_value(container["args"], "--fleet-key-file") == "/etc/kvbridge/fleet/fleet.key", where
    (vol,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "fleet"]
    assert vol["secret"]["secretName"] == "kvbridge-fleet" and not vol["secret"].get("optional"), where
    assert vol["secret"]["defaultMode"] == 0o440, where  # the user's group (fsGroup) reads it, no one else


def test_metrics_are_scraped():
    (sm,) = [doc for _, doc in DOCS if doc["kind"] == "ServiceMonitor"]
    selector = sm["spec"]["selector"]["matchLabels"]
    services = [doc for _, doc in DOCS if doc["kind"] == "Service"]
    assert services and all(all(doc["metadata"]["labels"].get(k) == v for k, v in selector.items()) for doc in services)
    assert {e["port"] for e in sm["spec"]["endpoints"]} == {"metrics"}
    assert all(any(p["name"] == "metrics" for p in doc["spec"]["ports"]) for doc in services)
    (cm,) = [doc for _, doc in DOCS if doc["kind"] == "ConfigMap" and "prometheus.yml" in doc["data"]]
    config = yaml.safe_load(cm["data"]["prometheus.yml"])
    (job,) = config["scrape_configs"]
    keeps = {r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps == {"kvbridge", "metrics"}


def _dockerfile() -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((ROOT / "Dockerfile").read_bytes()))


def test_dockerfile():
    df = _dockerfile()
    instructions = df.structure
    arg_default = {}
    for ins in instructions:
        if ins["instruction"] == "ARG" and "=" in ins["value"]:
            name, _, value = ins["value"].partition("=")
            arg_default.setdefault(name, value)
    assert arg_default["VARIANT"] == "cpu"
    froms = [ins["value"].split() for ins in instructions if ins["instruction"] == "FROM"]
    stages = {f[2]: f[0] for f in froms if len(f) == 3 and f[1].upper() == "AS"}
    assert stages["base-cpu"] == "${CPU_BASE}" and arg_default["CPU_BASE"] == "python:3.11-slim"
    assert stages["base-cuda"] == "${CUDA_BASE}" and arg_default["CUDA_BASE"].startswith("nvidia/cuda:")
    assert "runtime" in arg_default["CUDA_BASE"]
    assert stages["build"] == stages["runtime"] == "base-${VARIANT}"
    assert froms[-1][2] == "runtime"  # the image is the last stage
    build = instructions[next(i for i, ins in enumerate(instructions) if ins["value"].endswith("AS build")) :]
    assert any(ins["instruction"] == "COPY" and ins["value"].split() == [".", "/app"] for ins in build)
    runs = [ins["value"] for ins in build if ins["instruction"] == "RUN"]
    assert any("bash scripts/setup.sh" in r for r in runs)
    entrypoints = [ins["value"] for ins in instructions if ins["instruction"] == "ENTRYPOINT"]
    assert json.loads(entrypoints[-1]) == ["/app/.venv/bin/kvbridge"]  # exec form: the venv's console script
    assert df.baseimage == "base-cpu"  # the default variant, as dockerfile_parse resolves the ARG
    with_cuda = DockerfileParser(fileobj=io.BytesIO((ROOT / "Dockerfile").read_bytes()), build_args={"VARIANT": "cuda"})
    assert with_cuda.baseimage == "base-cuda"
    assert (ROOT / "scripts" / "setup.sh").exists()


def test_dockerignore():
    ignored = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()[:1] not in ("", "#")
    }
    assert {".git", ".venv", "**/__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"} <= ignored
    assert not ignored & {"scripts", "deploy", "pyproject.toml", "*.py", "**/*.py"}
