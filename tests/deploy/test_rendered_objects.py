"""What the chart renders: probes, resources and GPUs, selectors, policies, security, wiring."""

from __future__ import annotations

import ast
import json

import pytest

from tests.deploy.helpers import NAMESPACE, PIPELINE_SETS, RELEASE, REPO, VALUE_SETS, container, flag, render_chart

SERVICES = {"draft": 50052, "target": 50053, "orchestrator": 50051}
CONFIG_FILES = {
    "draft": REPO / "draft_service" / "config.py",
    "target": REPO / "target_service" / "config.py",
    "orchestrator": REPO / "orchestrator" / "config.py",
}
ALL_SETS = PIPELINE_SETS  # vllm-target: the tests at the end


def headless_address(component: str) -> str:
    return f"dns:///{RELEASE}-specdec-{component}.{NAMESPACE}.svc.cluster.local:{SERVICES[component]}"


def selector_matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(rendered) -> dict[str, dict]:
    return {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in rendered.workloads()}


def config_fields(path) -> dict[str, list[str] | None]:
    """Fields of a service's config class (and ServiceConfig's) -> the Literal choices, if any.

    Read from the source with `ast`, so the check costs no torch import.
    """
    fields: dict[str, list[str] | None] = {}
    aliases: dict[str, list[str]] = {}  # module-level `Name = Literal[...]`

    def literal(ann) -> list[str] | None:
        if isinstance(ann, ast.Name):
            return aliases.get(ann.id)
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Literal":
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            return [e.value for e in elts]
        return None

    for source in (REPO / "specdec" / "server" / "config.py", path):
        tree = ast.parse(source.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                choices = literal(node.value)
                if choices is not None:
                    aliases[node.targets[0].id] = choices
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    fields[stmt.target.id] = literal(stmt.annotation)
    return fields


# --------------------------------------------------------------------------- probes


@pytest.mark.parametrize("value_set", ALL_SETS)
@pytest.mark.parametrize("component", sorted(SERVICES))
def test_grpc_probes_on_the_service_port_with_a_model_load_budget(render, value_set, component):
    deployment = render(value_set).component("Deployment", component)
    if deployment is None:
        assert component == "draft" and value_set == "external-redis"
        return
    c = container(deployment["spec"]["template"]["spec"])
    [port] = [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"]
    assert port == SERVICES[component]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port}, probe
    startup = c["startupProbe"]
    budget_s = startup["periodSeconds"] * startup["failureThreshold"]
    # Model loads (and the first conversion of the packaged model) take minutes, not seconds.
    assert budget_s >= (600 if component in ("draft", "target") else 120), budget_s
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60


def test_gpu_split_extends_the_target_load_budget(render):
    target = render("gpu-split").component("Deployment", "target")
    startup = container(target["spec"]["template"]["spec"])["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 3600


# --------------------------------------------------------------------------- resources and GPUs


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_every_container_has_memory_requests_and_limits(render, value_set):
    for owner, spec in render(value_set).pod_specs().items():
        for c in spec["containers"]:
            assert "memory" in c["resources"]["requests"], owner
            assert "memory" in c["resources"]["limits"], owner


def test_default_is_cpu_only(render):
    for owner, spec in render("default").pod_specs().items():
        assert "nvidia.com/gpu" not in str(spec), owner


@pytest.mark.parametrize("component, gpu_type, pool", [("target", "NVIDIA-H100-80GB-HBM3", "gpu-large"),
                                                       ("draft", "NVIDIA-L4", "gpu-small")])
def test_gpu_split_puts_draft_on_small_and_target_on_large_gpus(render, component, gpu_type, pool):
    spec = render("gpu-split").component("Deployment", component)["spec"]["template"]["spec"]
    resources = container(spec)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["cpu"] and resources["limits"]["memory"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": gpu_type, "pool": pool}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert container(spec)["image"].endswith(":0.1.0-cu130")


def test_gpu_split_orchestrator_stays_on_cpu_nodes(render):
    spec = render("gpu-split").component("Deployment", "orchestrator")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in container(spec)["resources"].get("limits", {})
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert container(spec)["image"] == "registry.example.com/specdec:0.1.0"


def test_gpu_split_model_and_dtype_settings(render):
    r = render("gpu-split")
    target_args = container(r.component("Deployment", "target")["spec"]["template"]["spec"])["args"]
    draft_args = container(r.component("Deployment", "draft")["spec"]["template"]["spec"])["args"]
    orchestrator_args = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])["args"]
    assert flag(target_args, "--model") == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    assert flag(target_args, "--dtype") == "bfloat16"
    assert "--threads" not in target_args
    assert flag(draft_args, "--proposer") == "model"
    assert flag(draft_args, "--model") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert flag(orchestrator_args, "--model") == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    assert "--overlap" in orchestrator_args
    assert orchestrator_args[-4:] == ["--draft-timeout-s", "2", "--log-level", "INFO"]  # extraArgs go last


@pytest.mark.parametrize("component", ["target", "draft"])
def test_model_services_run_on_the_gpus_they_are_given(render, component):
    """GPU replicas are told `--device cuda`, so a pod that cannot use its GPU fails at start
    (the service checks the device before it loads the model) instead of serving from its CPU."""
    def device(*args):
        spec = render(*args).component("Deployment", component)["spec"]["template"]["spec"]
        return flag(container(spec)["args"], "--device")

    assert device("gpu-split") == "cuda"
    assert device("default") == "cpu"
    assert device("default", "--set", f"{component}.device=auto") == "auto"
    assert device("gpu-split", "--set", f"{component}.device=cuda:1") == "cuda:1"


# --------------------------------------------------------------------------- wiring


@pytest.mark.parametrize("value_set", ALL_SETS)
@pytest.mark.parametrize("component", sorted(SERVICES))
def test_rendered_flags_exist_in_the_service_config(render, value_set, component):
    deployment = render(value_set).component("Deployment", component)
    if deployment is None:
        return
    c = container(deployment["spec"]["template"]["spec"])
    module = {"draft": "draft_service", "target": "target_service", "orchestrator": "orchestrator"}[component]
    assert c["command"] == ["python", "-m", module]
    fields = config_fields(CONFIG_FILES[component])
    args = c["args"]
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name = arg[2:].replace("-", "_")
        if name.startswith("no_") and name[3:] in fields:
            continue
        assert name in fields, f"{arg} is not a flag of {module} (fields: {sorted(fields)})"
        choices = fields[name]
        if choices is not None:
            assert args[i + 1] in choices, f"{arg} {args[i + 1]} not in {choices}"
    assert flag(args, "--host") == "0.0.0.0"
    assert int(flag(args, "--port")) == SERVICES[component]


@pytest.mark.parametrize("value_set", ["default", "gpu-split"])
def test_orchestrator_reaches_each_replica_through_the_headless_services(render, value_set):
    r = render(value_set)
    args = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])["args"]
    assert flag(args, "--target") == headless_address("target")
    assert flag(args, "--draft") == headless_address("draft")
    for component in ("draft", "target"):
        service = r.component("Service", component)
        assert service["spec"]["clusterIP"] == "None"
        assert service["metadata"]["name"] == f"{RELEASE}-specdec-{component}"
        assert service["spec"]["ports"][0]["port"] == SERVICES[component]
        assert service["spec"]["ports"][0]["targetPort"] == "grpc"
    orchestrator_service = r.component("Service", "orchestrator")
    assert orchestrator_service["spec"].get("clusterIP") != "None"
    assert orchestrator_service["spec"]["ports"][0]["port"] == 50051


def test_without_a_draft_the_orchestrator_decodes_plainly(render):
    r = render("external-redis")
    args = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])["args"]
    assert flag(args, "--draft") == ""
    assert flag(args, "--target") == headless_address("target")
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"):
        assert r.component(kind, "draft") is None, kind


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_selectors_match_pod_labels(render, value_set):
    r = render(value_set)
    labels = pod_labels(r)
    for workload in r.workloads():
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector_matches(selector, workload["spec"]["template"]["metadata"]["labels"])
        others = [name for name, lab in labels.items()
                  if name != workload["metadata"]["name"] and selector_matches(selector, lab)]
        assert not others, f"{workload['metadata']['name']}'s selector also matches {others}"
    for kind, path in (("Service", ("spec", "selector")), ("PodDisruptionBudget", ("spec", "selector", "matchLabels")),
                       ("NetworkPolicy", ("spec", "podSelector", "matchLabels"))):
        for name, obj in r.of_kind(kind).items():
            selector = obj
            for key in path:
                selector = selector[key]
            matched = [w for w, lab in labels.items() if selector_matches(selector, lab)]
            assert len(matched) == 1, f"{kind}/{name} selects {matched}"
            assert matched[0] == name, f"{kind}/{name} selects {matched[0]}"


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_service_target_ports_are_named_container_ports(render, value_set):
    r = render(value_set)
    workloads = {w["metadata"]["name"]: w for w in r.workloads()}
    for name, service in r.of_kind("Service").items():
        c = container(workloads[name]["spec"]["template"]["spec"])
        port_names = {p["name"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names


# --------------------------------------------------------------------------- network policies


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_only_the_orchestrator_reaches_draft_target_and_redis(render, value_set):
    r = render(value_set)
    orchestrator_labels = r.component("Deployment", "orchestrator")["spec"]["selector"]["matchLabels"]
    ports = {**SERVICES, "redis": 6379}
    expected = {"target"} | ({"draft"} if r.component("Deployment", "draft") else set()) \
        | ({"redis"} if r.component("StatefulSet", "redis") else set())
    protected = set()
    for policy in r.of_kind("NetworkPolicy").values():
        component = policy["metadata"]["labels"]["app.kubernetes.io/component"]
        if component in ("orchestrator", "gateway"):  # the public APIs (tests/deploy/test_gateway_chart.py)
            continue
        protected.add(component)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        [rule] = policy["spec"]["ingress"]
        peers = [{"podSelector": {"matchLabels": orchestrator_labels}}]
        if component == "redis" and reads_outputs_stream(r):  # suffix speculation's shared corpus
            draft_labels = r.component("Deployment", "draft")["spec"]["selector"]["matchLabels"]
            peers.append({"podSelector": {"matchLabels": draft_labels}})
        assert rule["from"] == peers
        assert rule["ports"] == [{"protocol": "TCP", "port": ports[component]}]
    assert protected == expected


def reads_outputs_stream(r) -> bool:
    draft = r.component("Deployment", "draft")
    return bool(draft) and "--suffix-redis-url" in container(draft["spec"]["template"]["spec"])["args"]


# --------------------------------------------------------------------------- draft sources


def draft_container(r) -> dict:
    return container(r.component("Deployment", "draft")["spec"]["template"]["spec"])


def test_the_default_draft_is_suffix_speculation_reading_the_orchestrators_outputs(render):
    r = render("default")
    draft = draft_container(r)
    orchestrator = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])
    assert flag(draft["args"], "--proposer") == "suffix"
    # The stream the orchestrator writes (its session store) is the one the drafts read, with its password.
    assert flag(draft["args"], "--suffix-redis-url") == flag(orchestrator["args"], "--redis-url")
    assert flag(draft["args"], "--suffix-max-tokens") == "1000000"
    password = [e for e in draft.get("env", []) if e["name"] == "REDIS_PASSWORD"]
    assert password == [e for e in orchestrator["env"] if e["name"] == "REDIS_PASSWORD"] and password
    assert "--ngram-min" not in draft["args"]  # options of another proposer are not passed (the draft refuses them)
    assert reads_outputs_stream(r)


def test_the_target_has_the_redis_password_for_a_snapshot_store(render):
    r = render("default", "--set-json", 'target.extraArgs=["--snapshot-redis-url","redis://specdec-redis:6379/0"]')
    target = container(r.component("Deployment", "target")["spec"]["template"]["spec"])
    orchestrator = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])
    password = [e for e in target.get("env", []) if e["name"] == "REDIS_PASSWORD"]
    assert password == [e for e in orchestrator["env"] if e["name"] == "REDIS_PASSWORD"] and password
    target = container(render("default", "--set", "redis.auth.enabled=false").component(
        "Deployment", "target")["spec"]["template"]["spec"])
    assert not [e for e in target.get("env", []) if e["name"] == "REDIS_PASSWORD"]


def test_a_draft_without_the_shared_corpus_or_redis_auth(render):
    draft = draft_container(render("default", "--set", "draft.suffix.sharedCorpus=false"))
    assert "--suffix-redis-url" not in draft["args"]
    assert not [e for e in draft.get("env", []) if e["name"] == "REDIS_PASSWORD"]
    draft = draft_container(render("default", "--set", "redis.auth.enabled=false"))
    assert "--suffix-redis-url" in draft["args"]
    assert not [e for e in draft.get("env", []) if e["name"] == "REDIS_PASSWORD"]


def test_prompt_lookup_gets_its_options_and_nothing_of_suffix_speculation(render):
    r = render("default", "--set", "draft.proposer=ngram", "--set", "draft.ngramMin=1")
    args = draft_container(r)["args"]
    assert flag(args, "--proposer") == "ngram" and flag(args, "--ngram-min") == "1"
    assert not [a for a in args if a.startswith("--suffix-")]
    assert not reads_outputs_stream(r)


def test_a_redis_cluster_needs_the_shared_corpus_off(helm, render):
    r = render("external-redis-cluster")  # the value set turns it off
    assert flag(draft_container(r)["args"], "--proposer") == "suffix" and not reads_outputs_stream(r)
    proc = render_chart(helm, "-f", str(VALUE_SETS["external-redis-cluster"]),
                        "--set", "draft.suffix.sharedCorpus=true")
    assert proc.returncode != 0 and "draft.suffix.sharedCorpus=false" in proc.stderr, proc.stderr


def test_orchestrator_api_admits_only_the_gateway_and_the_helm_test_by_default(render):
    r = render("default")
    [rule] = r.component("NetworkPolicy", "orchestrator")["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 50051}]
    admitted = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in rule["from"]}
    assert admitted == {"gateway", "test"} and all(set(p) == {"podSelector"} for p in rule["from"])
    for component in ("gateway", "test"):
        kind = "Pod" if component == "test" else "Deployment"
        obj = r.component(kind, component)
        labels = (obj["spec"]["template"]["metadata"] if kind == "Deployment" else obj["metadata"])["labels"]
        assert any(selector_matches(p["podSelector"]["matchLabels"], labels) for p in rule["from"]), component
    # Without a gateway the gRPC API is the public one: open, unless orchestratorFrom says otherwise.
    [open_rule] = render("default", "--set", "gateway.enabled=false").component(
        "NetworkPolicy", "orchestrator")["spec"]["ingress"]
    assert "from" not in open_rule


def test_restricted_orchestrator_api_still_admits_the_helm_test(render):
    r = render("gpu-split")
    [rule] = r.component("NetworkPolicy", "orchestrator")["spec"]["ingress"]
    test_pod = r.component("Pod", "test")
    peers = rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}} in peers
    assert any("podSelector" in p and selector_matches(p["podSelector"]["matchLabels"], test_pod["metadata"]["labels"])
               for p in peers)


def test_network_policies_can_be_turned_off(render):
    assert not render("default", "--set", "networkPolicy.enabled=false").of_kind("NetworkPolicy")


# --------------------------------------------------------------------------- security


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_pods_run_non_root_with_no_capabilities_and_read_only_root(render, value_set):
    r = render(value_set)
    accounts = {a["metadata"]["labels"]["app.kubernetes.io/component"]: name
                for name, a in r.of_kind("ServiceAccount").items()}
    orchestrator = r.component("Deployment", "orchestrator")["metadata"]["name"]
    discovery = bool(r.of_kind("Role"))
    assert set(accounts) == ({"service-account", "orchestrator"} if discovery else {"service-account"})
    for owner, spec in r.pod_specs().items():
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        assert spec["securityContext"]["runAsUser"] > 0, owner
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, owner
        # Only an orchestrator that reads EndpointSlices (discovery.kubernetes) gets an API token.
        api_access = discovery and owner == orchestrator
        assert spec["automountServiceAccountToken"] is api_access, owner
        assert spec["serviceAccountName"] == accounts["orchestrator" if api_access else "service-account"], owner
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, owner
            assert sc["allowPrivilegeEscalation"] is False, owner
            assert sc["readOnlyRootFilesystem"] is True, owner
            assert sc["capabilities"]["drop"] == ["ALL"], owner
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]} or c["name"] == "redis", owner


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_services_keep_models_on_the_cache_volume(render, value_set):
    r = render(value_set)
    for component in SERVICES:
        deployment = r.component("Deployment", component)
        if deployment is None:
            continue
        spec = deployment["spec"]["template"]["spec"]
        c = container(spec)
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert env["SPECDEC_CACHE"] == mounts["model-cache"] == "/var/cache/specdec"
        assert env["HF_HOME"].startswith(mounts["model-cache"])
        volumes = {v["name"]: v for v in spec["volumes"]}
        if value_set == "gpu-split":
            claim = volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
            assert r.of_kind("PersistentVolumeClaim")[claim]["spec"]["accessModes"] == ["ReadWriteMany"]
            assert env["SPECDEC_ALLOW_DOWNLOAD"] == "1"
        else:
            assert volumes["model-cache"]["emptyDir"]["sizeLimit"]
            assert "SPECDEC_ALLOW_DOWNLOAD" not in env


# --------------------------------------------------------------------------- Redis


def test_in_chart_redis_uses_the_generated_secret(render):
    r = render("default")
    redis = r.component("StatefulSet", "redis")
    service = r.component("Service", "redis")
    secret = r.component("Secret", "redis")
    assert redis and service and secret
    assert len(secret["data"]["redis-password"]) > 20
    redis_container = container(redis["spec"]["template"]["spec"])
    assert flag(redis_container["args"], "--requirepass") == "$(REDIS_PASSWORD)"
    assert flag(redis_container["args"], "--appendonly") == "no"
    orchestrator = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])
    url = flag(orchestrator["args"], "--redis-url")
    assert url == f"redis://{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:6379/0"
    [password] = [e for e in orchestrator["env"] if e["name"] == "REDIS_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "redis-password"}
    # Kubernetes expands $(REDIS_PASSWORD) in args only from env vars defined in the container.
    assert [e["name"] for e in redis_container["env"]][:1] == ["REDIS_PASSWORD"]


def test_in_chart_redis_keeps_a_given_password(render):
    secret = render("default", "--set", "redis.auth.password=s3cret-Pass").component("Secret", "redis")
    assert secret["data"]["redis-password"] == "czNjcmV0LVBhc3M="


def test_redis_persistence_uses_an_append_only_file_on_a_claim(render):
    redis = render("gpu-split").component("StatefulSet", "redis")
    args = container(redis["spec"]["template"]["spec"])["args"]
    assert flag(args, "--appendonly") == "yes"
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"


def test_external_redis_renders_no_redis_and_uses_the_existing_secret(render):
    r = render("external-redis")
    for kind in ("StatefulSet", "Deployment", "Service", "Secret", "NetworkPolicy"):
        assert r.component(kind, "redis") is None, kind
    assert not r.of_kind("Secret")
    orchestrator = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])
    assert flag(orchestrator["args"], "--redis-url") == "rediss://sessions.redis.example.com:6380/2"
    [password] = [e for e in orchestrator["env"] if e["name"] == "REDIS_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": "specdec-redis", "key": "password"}


def test_external_redis_cluster_is_one_store_mode_over_tls(render):
    r = render("external-redis-cluster")
    assert r.component("StatefulSet", "redis") is None
    args = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])["args"]
    assert flag(args, "--redis-cluster-nodes").count(":6379") == 3
    assert "--redis-tls" in args and "--redis-url" not in args and "--redis-sentinels" not in args
    from orchestrator.config import OrchestratorConfig

    config = OrchestratorConfig.from_args(args)  # the orchestrator accepts these flags as one mode
    assert config.redis_tls and config.redis_cluster_nodes == flag(args, "--redis-cluster-nodes")


def test_external_redis_sentinels_name_their_master(render):
    sentinels = ("--set", "redis.external.clusterNodes=", "--set", "redis.external.tls=false",
                 "--set", "redis.external.sentinels=s-0:26379\\,s-1:26379")
    args = container(render("external-redis-cluster", *sentinels, "--set", "redis.external.sentinelMaster=sessions")
                     .component("Deployment", "orchestrator")["spec"]["template"]["spec"])["args"]
    assert flag(args, "--redis-sentinels") == "s-0:26379,s-1:26379"
    assert flag(args, "--redis-sentinel-master") == "sessions"
    assert "--redis-url" not in args and "--redis-cluster-nodes" not in args and "--redis-tls" not in args


@pytest.mark.parametrize("extra, message", [
    (("--set", "redis.external.url=redis://r:6379/0"), "set one of"),
    (("--set", "redis.external.clusterNodes=", "--set", "redis.external.sentinels=s:26379"), "sentinelMaster"),
    (("--set", "redis.enabled=true"), "need redis.enabled=false"),
])
def test_redis_modes_are_refused_when_ambiguous(helm, extra, message):
    proc = render_chart(helm, "-f", str(VALUE_SETS["external-redis-cluster"]), *extra)
    assert proc.returncode != 0 and message in proc.stderr


def test_redis_without_auth_sends_no_password(render):
    r = render("default", "--set", "redis.auth.enabled=false")
    assert r.component("Secret", "redis") is None
    orchestrator = container(r.component("Deployment", "orchestrator")["spec"]["template"]["spec"])
    assert "REDIS_PASSWORD" not in str(orchestrator)
    redis = container(r.component("StatefulSet", "redis")["spec"]["template"]["spec"])
    assert flag(redis["args"], "--protected-mode") == "no"


# --------------------------------------------------------------------------- availability and upgrades


@pytest.mark.parametrize("value_set", ALL_SETS)
def test_every_service_has_a_disruption_budget(render, value_set):
    r = render(value_set)
    for component in SERVICES:
        if r.component("Deployment", component) is None:
            continue
        pdb = r.component("PodDisruptionBudget", component)
        assert pdb["spec"]["maxUnavailable"] == 1


def test_orchestrator_drains_before_it_stops(render):
    deployment = render("default").component("Deployment", "orchestrator")
    spec = deployment["spec"]["template"]["spec"]
    sleep = container(spec)["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    # preStop sleep, then SIGTERM and the server's own drain (5 s grace), all before SIGKILL.
    assert spec["terminationGracePeriodSeconds"] >= int(sleep[1]) + 5
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert deployment["spec"]["replicas"] == 2


def test_autoscaled_orchestrator_has_an_hpa_and_no_fixed_replicas(render):
    r = render("gpu-split")
    [hpa] = r.of_kind("HorizontalPodAutoscaler").values()
    deployment = r.component("Deployment", "orchestrator")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert "replicas" not in deployment["spec"]
    assert not render("default").of_kind("HorizontalPodAutoscaler")


def test_gpu_target_upgrades_in_place_on_a_full_pool(render):
    deployment = render("gpu-split").component("Deployment", "target")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert deployment["spec"]["replicas"] == 2


# --------------------------------------------------------------------------- helm test


def test_helm_test_generates_through_the_orchestrator_service(render):
    r = render("default")
    pod = r.component("Pod", "test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = container(pod["spec"])
    assert c["command"] == ["specdec", "generate"]
    service = r.component("Service", "orchestrator")["metadata"]["name"]
    address = f"{service}.{NAMESPACE}.svc.cluster.local:50051"
    assert flag(c["args"], "--address") == address
    # With tokens the test holds none: it checks that the orchestrator refuses a call without one.
    gated = container(render("gateway-ingress").component("Pod", "test")["spec"])
    assert gated["command"] == ["python", "-c"] and "errors.Unauthenticated" in gated["args"][0]
    assert gated["args"][1] == address
    compile(gated["args"][0], "test-generate", "exec")


def test_in_chart_redis_has_a_memory_cap_and_evicts_no_session(render):
    args = container(render("default").component("StatefulSet", "redis")["spec"]["template"]["spec"])["args"]
    assert flag(args, "--maxmemory") == "768mb" and flag(args, "--maxmemory-policy") == "noeviction"
    args = container(render("default", "--set", "redis.maxmemory=3gb", "--set", "redis.resources.limits.memory=4Gi")
                     .component("StatefulSet", "redis")["spec"]["template"]["spec"])["args"]
    assert flag(args, "--maxmemory") == "3gb"
    uncapped = container(render("default", "--set", "redis.maxmemory=0").component(
        "StatefulSet", "redis")["spec"]["template"]["spec"])["args"]
    assert "--maxmemory" not in uncapped and flag(uncapped, "--maxmemory-policy") == "noeviction"


def test_literal_choices_are_read_from_the_configs():
    # Guards the ast reader above: if it silently found nothing, the flag test would prove little.
    fields = config_fields(CONFIG_FILES["draft"])
    assert fields["proposer"] == ["model", "ngram", "suffix", "hybrid"]
    assert "float32" in fields["dtype"]
    assert {"host", "port", "log_level"} <= set(fields)


# --------------------------------------------------------------------------- metrics


METRICS_ON = ("--set", "metrics.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
              "--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=observability")


def test_metrics_are_off_by_default(render):
    r = render("default")
    assert "metrics" not in str(r.docs).replace("/metrics", "")
    assert not r.of_kind("ServiceMonitor")


def test_metrics_port_service_monitor_and_scrape_rule(render):
    r = render("default", *METRICS_ON)
    scraped = (*SERVICES, "gateway")  # the gateway serves its HTTP request metrics too
    for component in scraped:
        c = container(r.component("Deployment", component)["spec"]["template"]["spec"])
        assert flag(c["args"], "--metrics-port") == "9400"
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in c["ports"]
        service = r.component("Service", component)
        assert any(p["name"] == "metrics" and p["targetPort"] == "metrics" for p in service["spec"]["ports"])
        [scrape] = [rule for rule in r.component("NetworkPolicy", component)["spec"]["ingress"]
                    if rule["ports"] == [{"protocol": "TCP", "port": 9400}]]
        assert scrape["from"] == [{"namespaceSelector": {"matchLabels": {"team": "observability"}}}]
    [monitor] = r.of_kind("ServiceMonitor").values()
    selector = monitor["spec"]["selector"]
    [expression] = selector["matchExpressions"]
    selected = {name for name, service in r.of_kind("Service").items()
                if selector_matches(selector["matchLabels"], service["metadata"]["labels"])
                and service["metadata"]["labels"][expression["key"]] in expression["values"]}
    assert selected == {f"{RELEASE}-specdec-{c}" for c in scraped}
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # Redis has no metrics port, and its policy stays orchestrator-only.
    assert len(r.component("NetworkPolicy", "redis")["spec"]["ingress"]) == 1


def test_metrics_objects_match_kubernetes_schemas(render):
    import kubernetes_validate

    for doc in render("default", *METRICS_ON).docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in kubernetes-validate
        kubernetes_validate.validate(doc, "1.33.0", strict=True)


# --------------------------------------------------------------------------- a vLLM target


def test_a_vllm_target_runs_beside_the_draft_pool_and_redis_alone(render):
    r = render("vllm-target")
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in r.workloads()} == {
        "vllm", "draft", "redis"}
    pod = r.component("Deployment", "vllm")["spec"]["template"]["spec"]
    vllm = container(pod)
    assert vllm["image"] == "registry.example/vllm-with-specdec:0.32.0"
    assert vllm["command"] == ["vllm", "serve"] and vllm["args"][0] == "/models/target"
    spec = json.loads(flag(vllm["args"], "--speculative-config"))
    assert spec == {"method": "custom_class", "model": "specdec.integrations.vllm.SpecdecProposer",
                    "num_speculative_tokens": 4}
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["SPECDEC_DRAFT_ADDRESS"] == headless_address("draft")
    assert env["SPECDEC_DRAFT_TIMEOUT_MS"] == "50" and env["SPECDEC_SHARE_OUTPUTS"] == "1"
    assert reads_outputs_stream(r)  # finished outputs reach every draft replica through Redis
    service = r.component("Service", "vllm")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_with_a_vllm_target_only_vllm_reaches_the_draft_pool(render):
    r = render("vllm-target")
    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in r.of_kind("NetworkPolicy").values()}
    assert set(policies) == {"draft", "redis"}
    vllm_labels = r.component("Deployment", "vllm")["spec"]["selector"]["matchLabels"]
    [rule] = policies["draft"]["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": vllm_labels}}]


@pytest.mark.parametrize("unset, message", [("image", "vllmTarget.image"), ("model", "vllmTarget.model")])
def test_a_vllm_target_needs_its_image_and_model(helm, unset, message):
    proc = render_chart(helm, "-f", str(VALUE_SETS["vllm-target"]), "--set", f"vllmTarget.{unset}=")
    assert proc.returncode != 0 and message in proc.stderr
