"""deploy/k8s/gateway/, the kvbridge fleet behind the Kubernetes inference gateway, checked without a
cluster: the core kinds with kubernetes-validate (strict), the InferencePool and the endpoint
picker's EndpointPickerConfig against our schemas in deploy/k8s/schemas/ (and those schemas against
broken documents), and the contract between the pieces: the pool selects the kvbridge prefill and
decode pods and nothing else, its target port is the router sidecar's HTTP port, its picker is the
EPP Service, the EPP scrapes the nodes' metrics port for the vLLM-named gauges they export, and each
decode pod's sidecar pairs the prefill node a header names with its own decode node."""

from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvbridge.cli import build_parser
from tests.e2e.test_deploy import K8S, K8S_VERSION, ROOT, SCHEMAS, _flag_value, _id, _pod_templates, check_probes

GATEWAY = K8S / "gateway"
CRD_KINDS = {"InferencePool", "HTTPRoute"}
WORKLOADS = ("StatefulSet", "Deployment", "LeaderWorkerSet")
POD_IP = "10.1.2.3"  # what the kubelet puts for $(POD_IP)
ROLE, MEMBER = "llm-d.ai/role", "llm-d.ai/inferenceServing"
# the flags of the EPP (GIE v1.3.1 pkg/epp/server/options.go, which llm-d-inference-scheduler v0.5.1 runs)
EPP_FLAGS = {
    "--grpc-port", "--ha-enable-leader-election", "--pool-group", "--pool-namespace", "--pool-name",
    "--endpoint-selector", "--endpoint-target-ports", "--model-server-metrics-scheme",
    "--model-server-metrics-path", "--model-server-metrics-port", "--refresh-metrics-interval",
    "--metrics-staleness-threshold", "--total-queued-requests-metric", "--total-running-requests-metric",
    "--kv-cache-usage-percentage-metric", "--lora-info-metric", "--cache-info-metric", "--v", "--tracing",
    "--health-checking", "--metrics-port", "--grpc-health-port", "--secure-serving", "--cert-path",
    "--metrics-endpoint-auth", "--config-file", "--config-text", "--zap-encoder",
}  # fmt: skip
EPP_PLUGINS = {
    "pd-profile-handler", "prefill-header-handler", "prefill-filter", "decode-filter", "queue-scorer",
    "kv-cache-utilization-scorer", "prefix-cache-scorer", "max-score-picker",
}  # fmt: skip


def _load(paths) -> list[tuple[str, dict]]:
    return [
        (str(p.relative_to(ROOT)), doc)
        for p in sorted(paths)
        for doc in yaml.safe_load_all(p.read_text())
        if doc is not None
    ]


DOCS = _load(GATEWAY.glob("*.yaml"))
ALL_DOCS = _load(K8S.rglob("*.yaml"))  # every manifest: what else the pool might select


def _one(kind: str, name: str | None = None, docs=DOCS) -> dict:
    (doc,) = [d for _, d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def _schema(name: str) -> dict:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _valid(doc: dict, schema: dict) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(doc)


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


POOL = _one("InferencePool")
DECODE = _one("StatefulSet", "kvbridge-decode")
EPP = _one("Deployment", "kvbridge-epp")
(EPP_CONTAINER,) = EPP["spec"]["template"]["spec"]["containers"]
EPP_ARGS = EPP_CONTAINER["args"]
KVBRIDGE = [
    (f"{path}:{doc['metadata']['name']}/{c['name']}", doc["spec"]["template"], c)
    for path, doc in DOCS
    if doc["kind"] in WORKLOADS
    for c in doc["spec"]["template"]["spec"]["containers"]
    if c["image"].startswith("kvbridge:")
]
CONTAINERS = {c["name"]: c for c in DECODE["spec"]["template"]["spec"]["containers"]}


def _epp_config() -> dict:
    """The EndpointPickerConfig the EPP reads: --config-file, in the ConfigMap mounted there."""
    folder, _, key = _flag_value(EPP_ARGS, "--config-file").rpartition("/")
    (mount,) = [m for m in EPP_CONTAINER["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in EPP["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return yaml.safe_load(_one("ConfigMap", volume["configMap"]["name"])["data"][key])


def test_manifests_found():
    kinds = {doc["kind"] for _, doc in DOCS}
    assert kinds == {
        "Service", "StatefulSet", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
        "Deployment", "InferencePool", "HTTPRoute",
    }  # fmt: skip
    assert all(doc["metadata"]["namespace"] == "kvbridge" for _, doc in DOCS)
    assert sorted(c["name"] for _, _, c in KVBRIDGE) == ["decode", "router"]


def test_the_decode_file_replaces_decode_and_router_in_place():
    """gateway/20-decode.yaml takes the names of 20-decode.yaml's objects and of the router's Service
    (30-router.yaml), so applying it instead of them updates those objects; the router's Deployment
    and PodDisruptionBudget are the ones left to delete (README)."""

    def names(*files):
        return {(d["kind"], d["metadata"]["name"]) for p, d in ALL_DOCS if p.endswith(files)}

    mine, plain = names("gateway/20-decode.yaml"), names("k8s/20-decode.yaml", "k8s/30-router.yaml")
    assert mine <= plain
    assert plain - mine == {("Deployment", "kvbridge-router"), ("PodDisruptionBudget", "kvbridge-router")}


@pytest.mark.parametrize("item", [d for d in DOCS if d[1]["kind"] not in CRD_KINDS], ids=_id)
def test_core_manifest_validates_strictly(item):
    kubernetes_validate.validate(item[1], K8S_VERSION, strict=True)


# ---------------------------------------------------------------------- the InferencePool


def test_inferencepool_validates_against_its_schema():
    jsonschema.validate(POOL, _schema("inferencepool.json"), cls=jsonschema.Draft202012Validator)
    assert POOL["apiVersion"] == "inference.networking.k8s.io/v1"
    assert POOL["spec"]["selector"] == {"matchLabels": {MEMBER: "true"}}
    assert POOL["spec"]["targetPorts"] == [{"number": 8000}]
    ref = POOL["spec"]["endpointPickerRef"]
    assert ref == {"kind": "Service", "name": "kvbridge-epp", "port": {"number": 9002}, "failureMode": "FailClose"}


def _broken(path: str, value) -> dict:
    """The pool with spec.<path> set to value (None: removed)."""
    doc = copy.deepcopy(POOL)
    *parents, last = path.split(".")
    node = doc["spec"]
    for p in parents:
        node = node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return doc


BROKEN_POOLS = {
    "empty matchLabels": ("selector.matchLabels", {}),
    "no matchLabels": ("selector.matchLabels", None),
    "65 labels": ("selector.matchLabels", {f"k{i}": "v" for i in range(65)}),
    "bad label value": ("selector.matchLabels", {MEMBER: "-true"}),
    "matchExpressions": ("selector.matchExpressions", [{"key": ROLE, "operator": "Exists"}]),
    "no targetPorts": ("targetPorts", []),
    "9 targetPorts": ("targetPorts", [{"number": 8000 + i} for i in range(9)]),
    "duplicate port numbers": ("targetPorts", [{"number": 8000}, {"number": 8001}, {"number": 8000}]),
    "port 0": ("targetPorts", [{"number": 0}]),
    "port 65536": ("targetPorts", [{"number": 65536}]),
    "port as a string": ("targetPorts", [{"number": "8000"}]),
    "port with a name": ("targetPorts", [{"number": 8000, "name": "http"}]),
    "no endpointPickerRef": ("endpointPickerRef", None),
    "Service ref without port": ("endpointPickerRef.port", None),
    "Service (by default) ref without port": ("endpointPickerRef", {"name": "kvbridge-epp"}),
    "ref without name": ("endpointPickerRef.name", None),
    "ref port 0": ("endpointPickerRef.port", {"number": 0}),
    "ref portNumber (a pre-v1.0 draft's spelling)": ("endpointPickerRef.portNumber", 9002),
    "bad failureMode": ("endpointPickerRef.failureMode", "FailClosed"),
    "bad appProtocol": ("appProtocol", "grpc"),
    "unknown spec field": ("targetPortNumber", 8000),
}


@pytest.mark.parametrize("name", BROKEN_POOLS)
def test_inferencepool_schema_rejects(name):
    assert not _valid(_broken(*BROKEN_POOLS[name]), _schema("inferencepool.json"))


def test_inferencepool_schema_accepts_what_gie_allows():
    schema = _schema("inferencepool.json")
    assert _valid(_broken("targetPorts", [{"number": 8000 + i} for i in range(8)]), schema)
    assert _valid(_broken("appProtocol", "kubernetes.io/h2c"), schema)
    assert _valid(_broken("endpointPickerRef", {"group": "example.com", "kind": "Picker", "name": "p"}), schema)
    unknown_top = copy.deepcopy(POOL) | {"extra": 1}
    assert not _valid(unknown_top, schema)


def test_pool_selects_the_kvbridge_prefill_and_decode_pods_only():
    """Every workload under deploy/k8s/ (extras/ and the plain decode fleet included): the pool
    selects exactly the prefill StatefulSet of 10-prefill.yaml and the decode StatefulSet of
    gateway/, whose pods carry the roles the picker's filters read."""
    selector = POOL["spec"]["selector"]["matchLabels"]
    selected = {}
    for path, doc in ALL_DOCS:
        if doc["kind"] in WORKLOADS:
            for i, tpl in enumerate(_pod_templates(doc)):
                if _selects(selector, tpl["metadata"]["labels"]):
                    selected[(path, doc["metadata"]["name"], i)] = tpl["metadata"]["labels"][ROLE]
    assert selected == {
        ("deploy/k8s/10-prefill.yaml", "kvbridge-prefill", 0): "prefill",
        ("deploy/k8s/gateway/20-decode.yaml", "kvbridge-decode", 0): "decode",
    }
    prefill = _one("StatefulSet", "kvbridge-prefill", ALL_DOCS)["spec"]["template"]["spec"]["containers"]
    assert [c["args"][0] for c in prefill] == ["prefill"]
    assert [c["args"][0] for c in CONTAINERS.values()] == ["decode", "router"]


def test_target_port_is_the_sidecars_http_port():
    (port,) = POOL["spec"]["targetPorts"]
    router = CONTAINERS["router"]
    assert int(_flag_value(router["args"], "--http-port")) == port["number"] == 8000
    assert {"name": "http", "containerPort": port["number"]} in router["ports"]
    others = [p["containerPort"] for c in CONTAINERS.values() for p in c["ports"] if p["name"] != "http"]
    assert port["number"] not in others


def test_endpoint_picker_ref_is_the_epp_service():
    ref = POOL["spec"]["endpointPickerRef"]
    service = _one(ref["kind"], ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert _selects(service["spec"]["selector"], EPP["spec"]["template"]["metadata"]["labels"])
    container_ports = {p["name"]: p["containerPort"] for p in EPP_CONTAINER["ports"]}
    assert container_ports[port["targetPort"]] == int(_flag_value(EPP_ARGS, "--grpc-port")) == 9002
    assert container_ports == {"grpc-ext-proc": 9002, "grpc-health": 9003, "http-metrics": 9090}
    for p in service["spec"]["ports"]:
        assert container_ports[p["targetPort"]] == p["port"]


def test_httproute_sends_to_the_pool():
    route = _one("HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert set(route) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(route["spec"]) == {"parentRefs", "rules"}
    (parent,) = route["spec"]["parentRefs"]
    assert parent["group"] == "gateway.networking.k8s.io" and parent["kind"] == "Gateway"
    (rule,) = route["spec"]["rules"]
    assert set(rule) <= {"matches", "backendRefs", "timeouts", "filters"}
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvbridge"}
    ]
    assert route["metadata"]["namespace"] == POOL["metadata"]["namespace"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]


# ---------------------------------------------------------------------- the endpoint picker


def test_epp_args():
    args = EPP_ARGS
    flags = {a.partition("=")[0] for a in args if a.startswith("--")}
    assert flags <= EPP_FLAGS, flags - EPP_FLAGS
    assert _flag_value(args, "--pool-name") == POOL["metadata"]["name"]
    assert _flag_value(args, "--pool-namespace") == POOL["metadata"]["namespace"]
    assert EPP_CONTAINER["image"] == "ghcr.io/llm-d/llm-d-inference-scheduler:v0.5.1"
    assert int(_flag_value(args, "--grpc-health-port")) == 9003
    for probe in ("readinessProbe", "livenessProbe"):
        assert EPP_CONTAINER[probe]["grpc"]["port"] == 9003
    assert int(_flag_value(args, "--metrics-port")) == 9090
    assert _flag_value(args, "--lora-info-metric") == ""  # kvbridge exports no LoRA gauge


def test_epp_scrapes_every_pooled_node_on_its_metrics_port():
    """The EPP scrapes each pod of the pool at --model-server-metrics-port (else the target port,
    the sidecar's HTTP, which serves no /metrics): the kvbridge node of every pooled pod serves its
    /metrics there."""
    port = int(_flag_value(EPP_ARGS, "--model-server-metrics-port"))
    assert _flag_value(EPP_ARGS, "--model-server-metrics-path") == "/metrics"
    nodes = [*_one("StatefulSet", "kvbridge-prefill", ALL_DOCS)["spec"]["template"]["spec"]["containers"]]
    nodes.append(CONTAINERS["decode"])
    for c in nodes:
        assert int(_flag_value(c["args"], "--metrics-port")) == port == 9400
        assert {"name": "metrics", "containerPort": port} in c["ports"]
    assert int(_flag_value(CONTAINERS["router"]["args"], "--metrics-port")) != port


def test_epp_reads_the_gauges_kvbridge_exports():
    """The EPP's metric flags keep their vLLM defaults, and a kvbridge node exports each of them."""
    from kvbridge.common.metrics import StatusCollector

    for flag in ("--total-queued-requests-metric", "--kv-cache-usage-percentage-metric", "--cache-info-metric"):
        assert flag not in EPP_ARGS
    status = {
        "queues": {"running": 1, "waiting": 2}, "ranks": [], "transfers_in_flight": 0, "requests_in_flight": 3,
        "draining": False, "pages_used": 3, "pages_total": 8,
    }  # fmt: skip
    names = {f.name for f in StatusCollector(lambda: status, model="m", page_size=16).collect()}
    assert {
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
    } <= names  # fmt: skip


def test_epp_rbac():
    sa = EPP["spec"]["template"]["spec"]["serviceAccountName"]
    assert _one("ServiceAccount", sa)
    binding = _one("RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "kvbridge"}]
    role = _one(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    grants = {
        (g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    for need in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert grants[need] == {"get", "list", "watch"}


def test_epp_config_validates_and_has_the_pd_profiles():
    config = _epp_config()
    jsonschema.validate(config, _schema("endpointpickerconfig.json"), cls=jsonschema.Draft202012Validator)
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert len(plugins) == len(config["plugins"])  # names are unique
    assert {p["type"] for p in config["plugins"]} == EPP_PLUGINS
    profiles = {p["name"]: p["plugins"] for p in config["schedulingProfiles"]}
    assert set(profiles) == {"prefill", "decode"}
    for name, refs in profiles.items():
        for ref in refs:
            assert ref["pluginRef"] in plugins, f"{name}: {ref['pluginRef']} is not declared"
        types = [plugins[r["pluginRef"]]["type"] for r in refs]
        assert types[0] == f"{name}-filter" and types.count("max-score-picker") == 1
        scorers = {plugins[r["pluginRef"]]["type"]: r.get("weight") for r in refs if "scorer" in r["pluginRef"]}
        assert set(scorers) == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}
        assert all(isinstance(w, int) and w > 0 for w in scorers.values()), scorers
    pd = plugins["pd-profile-handler"]["parameters"]
    prefix = plugins["prefix-cache-scorer"]["parameters"]
    assert pd == {"threshold": 0, "hashBlockSize": prefix["blockSize"]}  # every request gets a prefill pod
    assert prefix["autoTune"] is False  # a fixed block size, the one the handler counts hits in


def _epc_broken(change) -> dict:
    config = copy.deepcopy(_epp_config())
    change(config)
    return config


BROKEN_CONFIGS = {
    "unknown plugin type": lambda c: c["plugins"].append({"type": "queue-scorrer"}),
    "unknown plugin field": lambda c: c["plugins"][0].update(parameter={}),
    "weight as a fraction": lambda c: c["schedulingProfiles"][0]["plugins"][1].update(weight=1.5),
    "profile without plugins": lambda c: c["schedulingProfiles"][0].pop("plugins"),
    "no profiles": lambda c: c.update(schedulingProfiles=[]),
    "wrong apiVersion": lambda c: c.update(apiVersion="inference.networking.k8s.io/v1"),
    "unknown top-level field": lambda c: c.update(profiles=[]),
}


@pytest.mark.parametrize("name", BROKEN_CONFIGS)
def test_epp_config_schema_rejects(name):
    assert not _valid(_epc_broken(BROKEN_CONFIGS[name]), _schema("endpointpickerconfig.json"))


# ---------------------------------------------------------------------- the kvbridge containers


def _parse(args: list[str]):
    ns, unknown = build_parser().parse_known_args([a.replace("$(POD_IP)", POD_IP) for a in args])
    assert not unknown, f"unknown arguments {unknown}"
    return ns


@pytest.mark.parametrize("where,tpl,container", KVBRIDGE, ids=[c[0] for c in KVBRIDGE])
def test_every_flag_exists(where, tpl, container):
    ns = _parse(container["args"])
    assert ns.command == container["args"][0]
    if ns.command == "router":
        from kvbridge.router.cli import config_from_args

        config = config_from_args(ns)
        assert config.decode == (f"{POD_IP}:50051",) and not config.prefill and not config.colocated
        assert [t.partition("=")[0] for t in config.discover] == ["prefill"]
    else:
        from kvbridge.common.flags import from_flags
        from kvbridge.engine.config import PPConfig

        assert from_flags(PPConfig, ns).num_hosts == 1


def test_sidecar_pairs_the_named_prefill_node_with_its_own_decode_node():
    """The sidecar dials the pod's decode node where it listens (--host $(POD_IP)) and knows the
    prefill nodes from the headless Service of 10-prefill.yaml: a header naming any other address
    is refused (router/gateway.py), and the EPP's header is one it reads."""
    from kvbridge.router.gateway import PREFILL_HEADERS

    assert "x-prefiller-host-port" in PREFILL_HEADERS  # what prefill-header-handler sets
    decode, router = CONTAINERS["decode"], CONTAINERS["router"]
    assert _flag_value(decode["args"], "--host") == "$(POD_IP)"
    assert _flag_value(router["args"], "--decode") == f"$(POD_IP):{_flag_value(decode['args'], '--port')}"
    for c in (decode, router):
        (env,) = [e for e in c["env"] if e["name"] == "POD_IP"]
        assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    role, _, target = _flag_value(router["args"], "--discover").partition("=")
    host, _, port = target.rpartition(":")
    assert role == "prefill" and host == "kvbridge-prefill.kvbridge.svc.cluster.local"
    service = _one("Service", "kvbridge-prefill", ALL_DOCS)
    assert service["spec"]["clusterIP"] == "None"
    assert int(port) in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]


@pytest.mark.parametrize("where,tpl,container", KVBRIDGE, ids=[c[0] for c in KVBRIDGE])
def test_probes_ports_and_services(where, tpl, container):
    args = container["args"]
    port = check_probes(where, container)
    declared = {p["name"]: p["containerPort"] for p in container["ports"]}
    prefix = "router-" if args[0] == "router" else ""
    expected = {prefix + "grpc": port, prefix + "metrics": int(_flag_value(args, "--metrics-port"))}
    if args[0] == "router":
        expected["http"] = int(_flag_value(args, "--http-port"))
    assert declared == expected, where
    pod_ports = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"] for p in c["ports"]}
    assert len(pod_ports) == sum(len(c["ports"]) for c in tpl["spec"]["containers"])  # names unique in the pod
    for service in [d for _, d in DOCS if d["kind"] == "Service"]:
        if _selects(service["spec"]["selector"], tpl["metadata"]["labels"]):
            for p in service["spec"]["ports"]:
                assert pod_ports[p["targetPort"]] == p["port"], (service["metadata"]["name"], p)


@pytest.mark.parametrize("where,tpl,container", KVBRIDGE, ids=[c[0] for c in KVBRIDGE])
def test_fleet_key_tls_resources_and_pdb(where, tpl, container):
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
    assert mounts["fleet"]["mountPath"] == "/etc/kvbridge/fleet" and mounts["fleet"]["readOnly"], where
    assert _flag_value(container["args"], "--fleet-key-file") == "/etc/kvbridge/fleet/fleet.key", where
    assert volumes["fleet"]["secret"] == {"secretName": "kvbridge-fleet", "defaultMode": 0o440}, where
    assert mounts["tls"]["mountPath"] == "/etc/kvbridge/tls" and mounts["tls"]["readOnly"], where
    assert volumes["tls"]["secret"]["secretName"] == "kvbridge-tls", where
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), where
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys(), where
    labels = tpl["metadata"]["labels"]
    pdbs = [d for _, d in DOCS if d["kind"] == "PodDisruptionBudget"]
    assert len([d for d in pdbs if _selects(d["spec"]["selector"]["matchLabels"], labels)]) == 1, where
