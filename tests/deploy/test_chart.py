"""The chart as a whole: lint, values schema, and Kubernetes schemas for every value set."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import pytest

from tests.deploy.helpers import CHART, REPO, VALUE_SETS, render_chart, run_helm

# The chart's kubeVersion floor (native gRPC probes are GA from 1.27) and a current release.
KUBERNETES_VERSIONS = ["1.27.0", "1.33.0"]


def test_the_three_required_value_sets_exist():
    assert {"default", "gpu-split", "external-redis"} <= set(VALUE_SETS)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_strict(helm, value_set):
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(VALUE_SETS[value_set]))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_rendered_objects_match_kubernetes_schemas(render, value_set, version):
    rendered = render(value_set)
    assert rendered.docs
    for doc in rendered.docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {exc.message} "
                        f"at {'/'.join(map(str, exc.path))}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--set", "target.dtype=float8"], "/target/dtype"),
        (["--set", "draft.proposer=eagle"], "/draft/proposer"),
        (["--set", "targett.replicas=2"], "targett"),
        (["--set", "target.gpu.count=-1"], "/target/gpu/count"),
        (["--set", "orchestrator.draftLength=sometimes"], "/orchestrator/draftLength"),
        (["--set", "redis.enabled=false"], "/redis"),
        (["--set", "redis.enabled=false", "--set", "redis.external.url=redis://u:p@host:6379/0",
          "--set", "redis.auth.existingSecret=s"], "/redis/external/url"),
        (["--set", "redis.auth.password=p@ss/word"], "/redis/auth/password"),
    ],
)
def test_values_schema_rejects_bad_values(helm, overrides, message):
    proc = render_chart(helm, *overrides)
    assert proc.returncode != 0
    assert "schema" in proc.stderr and message in proc.stderr, proc.stderr


def test_values_schema_is_the_generated_one():
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "values_schema.py"), "--check"], check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_external_redis_with_auth_needs_a_secret(helm):
    proc = render_chart(helm, "--set", "redis.enabled=false", "--set", "redis.external.url=redis://r:6379/0")
    assert proc.returncode != 0
    assert "existingSecret" in proc.stderr or "password" in proc.stderr, proc.stderr


def test_notes_render(helm):
    proc = run_helm(helm, "install", "--dry-run=client", "sd", str(CHART), "--namespace", "specdec-ns")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/sd-specdec-orchestrator 50051:50051" in notes
    assert "helm test -n specdec-ns sd" in notes
    assert "proposer suffix, corpus shared through Redis" in notes
