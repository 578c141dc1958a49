"""Helpers for the deployment checks: where the chart is, running helm, reading what it rendered."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specdec"
VALUE_SETS = {path.name.removesuffix("-values.yaml"): path for path in sorted((CHART / "ci").glob("*-values.yaml"))}
# The value sets that run specdec's own target, orchestrator and gateway (vllm-target runs a vLLM target instead).
PIPELINE_SETS = sorted(set(VALUE_SETS) - {"vllm-target"})
RELEASE = "sd"
NAMESPACE = "specdec-ns"


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], check=False, capture_output=True, text=True, timeout=120)


@dataclass
class Rendered:
    """The objects `helm template` rendered for one value set."""

    docs: list[dict]

    def of_kind(self, kind: str) -> dict[str, dict]:
        """Objects of one kind by name."""
        return {d["metadata"]["name"]: d for d in self.docs if d["kind"] == kind}

    def component(self, kind: str, component: str) -> dict | None:
        """The one object of `kind` labelled with `component`, or None."""
        found = [d for d in self.docs if d["kind"] == kind
                 and d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) <= 1, f"{len(found)} {kind}s for {component}"
        return found[0] if found else None

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def pod_specs(self) -> dict[str, dict]:
        """Pod specs by owner name: every workload's template and every bare Pod (helm test)."""
        specs = {w["metadata"]["name"]: w["spec"]["template"]["spec"] for w in self.workloads()}
        specs.update({p["metadata"]["name"]: p["spec"] for p in self.docs if p["kind"] == "Pod"})
        return specs


def render_chart(helm: str, *args: str) -> subprocess.CompletedProcess:
    return run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


def container(pod_spec: dict, name: str | None = None) -> dict:
    """The named container of a pod spec (or its only one)."""
    containers = pod_spec["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def flag(args: list[str], name: str) -> str:
    """The value after `--name` in an argument list (the last one if repeated)."""
    positions = [i for i, a in enumerate(args) if a == name]
    assert positions, f"{name} not in {args}"
    return args[positions[-1] + 1]
