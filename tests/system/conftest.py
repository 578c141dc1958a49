"""Fixtures the system tests share."""

from __future__ import annotations

import pytest
from openai import OpenAI

from specdec.launcher import free_port
from tests.conftest import start_tiny_pipeline


@pytest.fixture(scope="session")
def http_pipeline(tiny_models, tmp_path_factory):
    """The tiny pipeline (poor draft) with the OpenAI-compatible gateway: one for every HTTP test. The
    gateway's Prometheus metrics are on `pipeline.gateway_metrics_port`."""
    metrics_port = free_port()
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-http"), tiny_models, "poor_draft",
                                   http_port=free_port(), extra_http_args=["--metrics-port", str(metrics_port)])
    pipeline.gateway_metrics_port = metrics_port
    yield pipeline
    pipeline.stop()


@pytest.fixture(scope="session")
def api(http_pipeline) -> OpenAI:
    """The official `openai` client against the gateway, without retries."""
    return OpenAI(base_url=http_pipeline.plan.http_url(), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(api) -> str:
    """The model id the gateway serves."""
    return api.models.list().data[0].id


@pytest.fixture(scope="session")
def long_models(tmp_path_factory):
    """Tiny target and poor draft with a 4096-token context (a character a token): long prompts, tools."""
    from specdec.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models-4k")
    target = make_tiny_model(root / "target", seed=0, max_context=4096)
    return {"target": target, "poor_draft": make_tiny_model(root / "poor_draft", base=target, perturb=1.5, seed=2,
                                                            max_context=4096)}


@pytest.fixture(scope="session")
def long_pipeline(long_models, tmp_path_factory):
    """The long-context pair with the gateway, and a per-call verify limit (0.2 s) far below what a
    long prefill takes under load: the orchestrator must tell busy from dead."""
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-long"), long_models, "poor_draft",
                                   http_port=free_port(), extra_orchestrator_args=["--target-timeout-s", "0.2"])
    yield pipeline
    pipeline.stop()
