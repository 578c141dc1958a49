"""deploy/image_test, the translator `make image-test` runs the chart with, checked on
the rendered chart without podman: every workload the chart renders becomes a container that
keeps the manifest's command, args, env, user, read-only root, capabilities and probes."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import pytest

from deploy.image_test import acceptance, manifests, podman
from tests.deploy.helpers import NAMESPACE

WORKLOAD_KINDS = ("Deployment", "StatefulSet")


@pytest.fixture(scope="module")
def docs(render):
    return copy.deepcopy(render("default").docs)


@pytest.fixture(scope="module")
def plan(docs):
    return manifests.translate(docs, image_map={"redis:7.4-alpine": "specdec:test"})


def _secrets(docs):
    return {(d["metadata"]["name"], k): base64.b64decode(v).decode()
            for d in docs if d["kind"] == "Secret" for k, v in (d.get("data") or {}).items()}


def test_every_rendered_workload_and_container_is_planned(docs, plan):
    rendered = {(d["metadata"]["name"], c["name"]) for d in docs if d["kind"] in WORKLOAD_KINDS
                for c in d["spec"]["template"]["spec"]["containers"]}
    planned = {(c.workload, c.name) for c in plan.workloads}
    assert rendered and planned == rendered
    components = {c.component for c in plan.workloads}
    assert {"redis", "target", "orchestrator"} <= components


def test_commands_args_and_env_are_the_manifests(docs, plan):
    secrets = _secrets(docs)
    by_id = {(c.workload, c.name): c for c in plan.containers}
    for d in docs:
        if d["kind"] not in (*WORKLOAD_KINDS, "Pod"):
            continue
        pod = d["spec"]["template"]["spec"] if d["kind"] in WORKLOAD_KINDS else d["spec"]
        for spec in pod["containers"]:
            c = by_id[(d["metadata"]["name"], spec["name"])]
            assert c.command == spec.get("command")
            for env in spec.get("env") or []:
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    assert c.env[env["name"]] == secrets[(ref["name"], ref["key"])]
                elif "value" in env:
                    assert c.env[env["name"]] == str(env["value"])
            # $(VAR) in args is expanded from the container's env, as the kubelet does.
            expected = [manifests.expand(str(a), c.env) for a in spec.get("args") or []]
            assert (c.args or []) == expected
            assert not any("$(" in a for a in c.args or [])


def test_redis_gets_the_secret_password_and_the_mapped_image(docs, plan):
    redis = next(c for c in plan.workloads if c.component == "redis")
    assert redis.image == "specdec:test"
    password = redis.env["REDIS_PASSWORD"]
    assert password and redis.args[redis.args.index("--requirepass") + 1] == password


def test_security_context_is_kept(plan):
    for c in plan.containers:
        assert c.user not in (None, 0) and c.run_as_non_root
        assert c.read_only
        assert c.cap_drop == ["ALL"] and c.no_new_privileges
        args = podman.run_args(c, pod="p", run_dir=Path("/run"), run_id="r")
        assert args[args.index("--user") + 1] == f"{c.user}:{c.group}"
        assert "--read-only" in args and "--read-only-tmpfs=false" in args
        assert args[args.index("--cap-drop") + 1] == "ALL"
        assert "/run/hosts:/etc/hosts:ro" in args
        if c.memory_limit:
            assert int(args[args.index("--memory") + 1]) == c.memory_limit


def test_run_args_keep_command_then_image_then_args(plan):
    for c in plan.containers:
        args = podman.run_args(c, pod="p", run_dir=Path("/run"), run_id="r")
        i = args.index(c.image)
        assert args[i + 1:] == (c.args or [])
        if c.command:
            assert json.loads(args[args.index("--entrypoint") + 1]) == c.command


def test_service_names_resolve_to_loopback(docs, plan):
    for svc in (d for d in docs if d["kind"] == "Service"):
        name = svc["metadata"]["name"]
        assert f"{name}.{NAMESPACE}.svc.cluster.local" in plan.hosts
    assert f"127.0.0.1\t{plan.hosts[0]}" in manifests.hosts_file(plan)
    # Every address a container is given points at a name in the hosts file.
    for c in plan.workloads:
        for arg in c.args or []:
            if ".svc.cluster.local" in arg:
                host = arg.split("://")[-1].lstrip("/").split("/")[0].rsplit(":", 1)[0]
                assert host in plan.hosts, arg


def test_probes_are_translated(plan):
    probed = [c for c in plan.workloads if c.probes]
    assert len(probed) == len(plan.workloads)
    redis = next(c for c in plan.workloads if c.component == "redis")
    assert redis.probes["startup"].kind == "tcp" and redis.probes["startup"].port == redis.ports["redis"]
    assert redis.probes["readiness"].kind == "exec" and "redis-cli" in " ".join(redis.probes["readiness"].command)
    target = next(c for c in plan.workloads if c.component == "target")
    assert target.probes["startup"].kind == "grpc" and target.probes["startup"].port == target.ports["grpc"]
    assert target.restart


def test_helm_test_pods_become_tests(docs, plan):
    hooks = [d["metadata"]["name"] for d in docs if d["kind"] == "Pod"
             and "test" in (d["metadata"].get("annotations") or {}).get("helm.sh/hook", "")]
    assert hooks and sorted(t.workload for t in plan.tests) == sorted(hooks)
    assert all(not t.restart for t in plan.tests)


def test_gateway_is_found_or_made_from_the_orchestrator(docs):
    with_gateway = manifests.translate(docs)
    found = acceptance.gateway_container(with_gateway)
    rendered = any("http_gateway" in (c.get("command") or []) for d in docs if d["kind"] == "Deployment"
                   for c in d["spec"]["template"]["spec"]["containers"])
    assert (found is not None) == rendered
    without = manifests.translate([d for d in docs
                                   if d["metadata"]["labels"].get("app.kubernetes.io/component") != "gateway"])
    assert acceptance.gateway_container(without) is None
    gw, port = acceptance.add_fallback_gateway(without)
    assert gw.command == ["python", "-m", "http_gateway"] and gw.user == 10001 and gw.read_only
    orchestrator_host = gw.args[gw.args.index("--orchestrator") + 1].rsplit(":", 1)[0]
    assert orchestrator_host in without.hosts and acceptance.gateway_container(without) == (gw, port)


def test_prepare_writes_env_files_hosts_and_volumes(plan, tmp_path):
    podman.prepare(plan, tmp_path)
    assert (tmp_path / "hosts").read_text() == manifests.hosts_file(plan)
    for c in plan.containers:
        env = (tmp_path / "env" / c.id).read_text().splitlines()
        assert sorted(line.split("=", 1)[0] for line in env if line) == sorted(c.env)
        assert (tmp_path / "env" / c.id).stat().st_mode & 0o077 == 0  # secrets inside
        for m in c.mounts:
            assert (tmp_path / "volumes" / m.volume).is_dir()


def test_expand_follows_kubernetes():
    env = {"A": "x", "B": "y"}
    assert manifests.expand("$(A)-$(B)", env) == "x-y"
    assert manifests.expand("$$(A)", env) == "$(A)"
    assert manifests.expand("$(UNSET)", env) == "$(UNSET)"


def test_quantities():
    assert manifests.parse_quantity("4Gi") == 4 * 2**30
    assert manifests.parse_quantity("500m") == 0.5
    assert manifests.parse_quantity(2) == 2
    with pytest.raises(manifests.TranslationError):
        manifests.parse_quantity("lots")


def test_two_workloads_on_one_port_are_refused(docs):
    docs = copy.deepcopy(docs)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    a, b = deployments[0], deployments[1]
    port = a["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    b["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = port
    with pytest.raises(manifests.TranslationError, match="share one loopback"):
        manifests.translate(docs)


def test_auth_keys_reach_the_orchestrator_and_the_gateway_readable_by_their_user(helm, tmp_path):
    """`run --auth-secret`: a Secret with two keys beside the chart rendered with auth.existingSecret;
    both public APIs mount its tokens file, and the pod's user reads it through its fsGroup."""
    import argparse
    import os

    from deploy.image_test import cli

    opts = argparse.Namespace(rendered="", helm=helm, release="it", chart=str(cli.ROOT / "helm" / "specdec"),
                              namespace=NAMESPACE, set=[], values=[], auth_secret="it-keys")
    rendered = tmp_path / "rendered.yaml"
    assert cli.render(opts, rendered)
    keys = cli.add_keys_secret(opts, rendered)
    assert set(keys) == {"alice", "bob"} and all(len(t) >= 16 for t in keys.values())
    pod = manifests.translate(manifests.load(rendered.read_text()), image_map={"redis:7.4-alpine": "specdec:test"})
    mounted = {}
    for c in pod.workloads:
        if "--auth-tokens-file" in c.words:
            path = c.words[c.words.index("--auth-tokens-file") + 1]
            [mount] = [m for m in c.mounts if path.startswith(m.path + "/")]
            mounted[c.component] = (pod.volumes[mount.volume], mount.read_only, c.fs_group)
    assert set(mounted) == {"orchestrator", "gateway"}
    for volume, read_only, _ in mounted.values():
        assert read_only and volume.files["tokens"].decode() == "".join(f"{n}:{t}\n" for n, t in keys.items())
    podman.prepare(pod, tmp_path / "run")
    for key, (volume, _, fs_group) in mounted.items():
        info = os.stat(tmp_path / "run" / "volumes" / volume.key / "tokens")
        assert info.st_mode & 0o777 == 0o440, key
        if os.geteuid() == 0:
            assert info.st_gid == fs_group, key  # as the kubelet writes it: the pod's user reads it
    os.environ.pop(acceptance.KEYS_ENV, None)
    assert acceptance.keys_of_env() == {}
    os.environ[acceptance.KEYS_ENV] = ",".join(f"{n}:{t}" for n, t in keys.items())
    try:
        assert acceptance.keys_of_env() == keys
    finally:
        del os.environ[acceptance.KEYS_ENV]
    assert acceptance.orchestrator_port(pod) == 50051
