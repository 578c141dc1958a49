"""The chart's OpenAI-compatible gateway and its Kubernetes API discovery for the orchestrator."""

from __future__ import annotations

import pytest

from tests.deploy.helpers import CHART, NAMESPACE, PIPELINE_SETS, RELEASE, REPO, container, flag, render_chart, run_helm
from tests.deploy.test_rendered_objects import config_fields, selector_matches

ALL_SETS = PIPELINE_SETS
GATEWAY_CONFIG = REPO / "http_gateway" / "config.py"
ORCHESTRATOR_ADDRESS = f"{RELEASE}-specdec-orchestrator.{NAMESPACE}.svc.cluster.local:50051"
ENDPOINTSLICE_RULE = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"]}


def pod_spec(rendered, component: str) -> dict:
    return rendered.component("Deployment", component)["spec"]["template"]["spec"]


def gateway_container(rendered) -> dict:
    return container(pod_spec(rendered, "gateway"))


# --------------------------------------------------------------------------- the gateway


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_gateway_runs_the_http_gateway_against_the_orchestrator_service(render, value_set):
    r = render(value_set)
    c = gateway_container(r)
    assert c["command"] == ["python", "-m", "http_gateway"]
    args = c["args"]
    fields = config_fields(GATEWAY_CONFIG)
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            assert arg[2:].replace("-", "_") in fields, f"{arg} is not a flag of http_gateway"
            choices = fields[arg[2:].replace("-", "_")]
            assert choices is None or args[i + 1] in choices, arg
    assert flag(args, "--host") == "0.0.0.0"
    assert int(flag(args, "--port")) == 8000
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # The orchestrator's ClusterIP Service, by its cluster DNS name and service port.
    assert flag(args, "--orchestrator") == ORCHESTRATOR_ADDRESS
    orchestrator = r.component("Service", "orchestrator")
    assert ORCHESTRATOR_ADDRESS.startswith(orchestrator["metadata"]["name"] + f".{NAMESPACE}.")
    assert orchestrator["spec"]["ports"][0]["port"] == 50051
    # Metrics are off by default (metrics.enabled): no metrics flag, port or scrape rule.
    assert "--metrics-port" not in args


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_gateway_probes_health_over_http(render, value_set):
    c = gateway_container(render(value_set))
    readiness = c["readinessProbe"]
    assert readiness["httpGet"] == {"path": "/health", "port": "http"}
    # /health waits up to --health-timeout-s for the orchestrator: the probe must wait longer.
    assert float(flag(c["args"], "--health-timeout-s")) < readiness["timeoutSeconds"]
    # Startup and liveness only need the port: a backend outage must not restart every gateway.
    assert c["startupProbe"]["tcpSocket"] == {"port": "http"}
    assert c["livenessProbe"]["tcpSocket"] == {"port": "http"}
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60


def test_gateway_rejects_a_health_timeout_the_readiness_probe_cannot_wait_for(helm):
    proc = render_chart(helm, "--set", "gateway.healthTimeoutS=5")
    assert proc.returncode != 0
    assert "gateway.healthTimeoutS" in proc.stderr, proc.stderr


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_gateway_pod_is_locked_down_and_holds_no_model(render, value_set):
    r = render(value_set)
    spec = pod_spec(r, "gateway")
    c = container(spec)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert "model-cache" not in {v["name"] for v in spec["volumes"]}
    assert "SPECDEC_CACHE" not in {e["name"] for e in c["env"]}
    assert "memory" in c["resources"]["limits"]
    assert container(spec)["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_gateway_service_pdb_and_no_ingress_by_default(render):
    r = render("default")
    service = r.component("Service", "gateway")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                         "appProtocol": "http"}]
    labels = r.component("Deployment", "gateway")["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(service["spec"]["selector"], labels)
    assert r.component("PodDisruptionBudget", "gateway")["spec"]["maxUnavailable"] == 1
    assert r.component("Deployment", "gateway")["spec"]["replicas"] == 2
    assert not r.of_kind("Ingress")
    assert r.component("HorizontalPodAutoscaler", "gateway") is None


def test_gateway_ingress_routes_to_the_service_with_tls(render):
    r = render("gateway-ingress")
    [ingress] = r.of_kind("Ingress").values()
    service = r.component("Service", "gateway")["metadata"]["name"]
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-example-com-tls"}]
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert [(p["path"], p["pathType"]) for p in rule["http"]["paths"]] == [("/v1", "Prefix"), ("/health", "Exact")]
    for path in rule["http"]["paths"]:
        assert path["backend"]["service"] == {"name": service, "port": {"name": "http"}}
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_autoscaled_gateway_has_an_hpa_and_no_fixed_replicas(render):
    r = render("gateway-ingress")
    hpa = r.component("HorizontalPodAutoscaler", "gateway")
    deployment = r.component("Deployment", "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 10)
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 60
    assert "replicas" not in deployment["spec"]


def tokens_secret(rendered, component: str) -> tuple[str, str] | None:
    """(Secret, key) that `component` reads its --auth-tokens-file from, through a read-only mount."""
    spec = pod_spec(rendered, component)
    c = container(spec)
    if "--auth-tokens-file" not in c["args"]:
        assert not any("secret" in v for v in spec["volumes"])
        return None
    path = flag(c["args"], "--auth-tokens-file")
    [mount] = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    [item] = volume["secret"]["items"]
    assert item["path"] == path.rsplit("/", 1)[1]
    return volume["secret"]["secretName"], item["key"]


def test_both_public_apis_check_the_tokens_of_one_secret(render, helm):
    """The gateway checks a caller's token and forwards it; the orchestrator checks the same tokens
    (so sessions are bound to each key, and a pod that reaches it directly needs one)."""
    r = render("gateway-ingress")
    assert flag(gateway_container(r)["args"], "--model-name") == "smollm2"
    for component in ("gateway", "orchestrator"):
        assert tokens_secret(r, component) == ("specdec-gateway-tokens", "tokens"), component
    # gateway.auth, the deprecated alias, guards the orchestrator too.
    alias = render("default", "--set", "gateway.auth.existingSecret=old-tokens", "--set", "gateway.auth.tokensKey=k")
    for component in ("gateway", "orchestrator"):
        assert tokens_secret(alias, component) == ("old-tokens", "k"), component
    proc = render_chart(helm, "--set", "auth.existingSecret=a", "--set", "gateway.auth.existingSecret=b")
    assert proc.returncode != 0 and "set auth.existingSecret alone" in proc.stderr
    # Without auth there is no tokens flag and no secret volume anywhere.
    default = render("default")
    assert tokens_secret(default, "gateway") is None and tokens_secret(default, "orchestrator") is None
    assert "--model-name" not in gateway_container(default)["args"]


def test_gateway_network_policy_and_its_way_to_the_orchestrator(render):
    default = render("default")
    [rule] = default.component("NetworkPolicy", "gateway")["spec"]["ingress"]
    assert rule == {"ports": [{"protocol": "TCP", "port": 8000}]}  # open to any client by default

    r = render("gateway-ingress")
    labels = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in r.of_kind("Deployment").items()}
    gateway_labels = labels[f"{RELEASE}-specdec-gateway"]
    [rule] = r.component("NetworkPolicy", "gateway")["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}} in rule["from"]
    test_pod = r.component("Pod", "test-gateway")
    assert any("podSelector" in p and selector_matches(p["podSelector"]["matchLabels"], test_pod["metadata"]["labels"])
               for p in rule["from"])
    # A restricted orchestrator API still admits the gateway's pods (and only with matching labels).
    [orchestrator_rule] = r.component("NetworkPolicy", "orchestrator")["spec"]["ingress"]
    assert any("podSelector" in p and p["podSelector"]["matchLabels"].get("app.kubernetes.io/instance") == RELEASE
               and selector_matches(p["podSelector"]["matchLabels"], gateway_labels)
               for p in orchestrator_rule["from"])
    # Draft, target and Redis stay orchestrator-only: the gateway is not among their peers.
    for component in ("draft", "target", "redis"):
        [backend_rule] = r.component("NetworkPolicy", component)["spec"]["ingress"]
        assert not any(selector_matches(p["podSelector"]["matchLabels"], gateway_labels) for p in backend_rule["from"])


def test_gateway_helm_test_calls_the_gateway_service(render):
    r = render("default")
    pod = r.component("Pod", "test-gateway")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = container(pod["spec"])
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["GATEWAY_URL"] == f"http://{RELEASE}-specdec-gateway.{NAMESPACE}.svc.cluster.local:8000"
    assert env["CHECK_COMPLETION"] == "1"
    assert "/v1/completions" in c["args"][0] and "/health" in c["args"][0]
    compile(c["args"][0], "test-gateway", "exec")  # the inline script is valid Python
    # With tokens checked the test has none to send: /health, and a request without one refused.
    gated = container(render("gateway-ingress").component("Pod", "test-gateway")["spec"])
    assert {e["name"]: e["value"] for e in gated["env"]}["CHECK_COMPLETION"] == "0"
    assert "err.code == 401" in gated["args"][0]


def test_gateway_can_be_turned_off(render):
    r = render("gpu-split", "--set", "gateway.enabled=false")
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy", "Ingress"):
        assert r.component(kind, "gateway") is None, kind
    assert r.component("Pod", "test-gateway") is None
    [rule] = r.component("NetworkPolicy", "orchestrator")["spec"]["ingress"]
    assert not any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "gateway"
                   for p in rule["from"])


def test_notes_show_the_gateway(helm):
    proc = run_helm(helm, "install", "--dry-run=client", "sd", str(CHART), "--namespace", "specdec-ns")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/sd-specdec-gateway 8000:8000" in notes
    assert "http://127.0.0.1:8000/v1/completions" in notes


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--set", "gateway.service.type=Ingress"], "/gateway/service/type"),
        (["--set", "gateway.port=0"], "/gateway/port"),
        (["--set", "gateway.ingress.hosts[0].paths[0].pathType=Regex"], "/gateway/ingress/hosts/0/paths/0/pathType"),
        (["--set", "gateway.ingress.enabled=true", "--set-json", "gateway.ingress.hosts=[]"], "/gateway/ingress/hosts"),
        (["--set", "gateway.healthTimeoutS=0"], "/gateway/healthTimeoutS"),
        (["--set", "gateway.replica=2"], "replica"),
        (["--set", "discovery.kubernetes=sometimes"], "/discovery/kubernetes"),
    ],
)
def test_values_schema_rejects_bad_gateway_and_discovery_values(helm, overrides, message):
    proc = render_chart(helm, *overrides)
    assert proc.returncode != 0
    assert "schema" in proc.stderr and message in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- discovery through the API


def backend_spec(component: str, port: int) -> str:
    return f"kubernetes:///{NAMESPACE}/{RELEASE}-specdec-{component}:{port}"


def test_kubernetes_discovery_wires_the_orchestrator_to_endpointslices(render):
    r = render("kubernetes-discovery")
    spec = pod_spec(r, "orchestrator")
    c = container(spec)
    assert flag(c["args"], "--target") == backend_spec("target", 50053)
    assert flag(c["args"], "--draft") == backend_spec("draft", 50052)
    # The specs name the headless Services the chart renders.
    for component, port in (("target", 50053), ("draft", 50052)):
        service = r.component("Service", component)
        assert service["metadata"]["name"] == f"{RELEASE}-specdec-{component}"
        assert service["spec"]["ports"][0]["port"] == port
    [node] = [e for e in c["env"] if e["name"] == "SPECDEC_NODE_NAME"]
    assert node["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # The orchestrator, and only it, carries an API token, through its own ServiceAccount.
    account = spec["serviceAccountName"]
    assert spec["automountServiceAccountToken"] is True
    assert account in r.of_kind("ServiceAccount")
    for name, other in r.pod_specs().items():
        if name != r.component("Deployment", "orchestrator")["metadata"]["name"]:
            assert other["serviceAccountName"] != account, name
            assert other["automountServiceAccountToken"] is False, name


def test_kubernetes_discovery_role_grants_only_reading_endpointslices(render):
    r = render("kubernetes-discovery")
    [role] = r.of_kind("Role").values()
    assert role["metadata"]["namespace"] == NAMESPACE
    [rule] = role["rules"]
    assert {k: v for k, v in rule.items() if k != "verbs"} == ENDPOINTSLICE_RULE
    assert sorted(rule["verbs"]) == ["get", "list", "watch"]
    assert not r.of_kind("ClusterRole") and not r.of_kind("ClusterRoleBinding")
    [binding] = r.of_kind("RoleBinding").values()
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                    "name": pod_spec(r, "orchestrator")["serviceAccountName"]}]


@pytest.mark.parametrize("value_set", sorted(set(ALL_SETS) - {"kubernetes-discovery"}))
def test_without_kubernetes_discovery_there_is_no_rbac_and_dns_addresses(render, value_set):
    r = render(value_set)
    for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert not r.of_kind(kind), kind
    c = container(pod_spec(r, "orchestrator"))
    assert flag(c["args"], "--target").startswith("dns:///")
    assert "kubernetes:///" not in str(c["args"])
    assert "SPECDEC_NODE_NAME" not in {e["name"] for e in c["env"]}


def test_kubernetes_discovery_without_a_draft(render):
    c = container(pod_spec(render("kubernetes-discovery", "--set", "draft.enabled=false"), "orchestrator"))
    assert flag(c["args"], "--target") == backend_spec("target", 50053)
    assert flag(c["args"], "--draft") == ""


def test_kubernetes_discovery_binds_a_given_service_account(render):
    r = render("kubernetes-discovery", "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=mine")
    assert not r.of_kind("ServiceAccount")
    assert pod_spec(r, "orchestrator")["serviceAccountName"] == "mine"
    [binding] = r.of_kind("RoleBinding").values()
    assert binding["subjects"][0]["name"] == "mine"
