"""Fixtures the system tests share."""

from __future__ import annotations

import pytest
from openai import OpenAI

from specdec.launcher import free_port
from tests.conftest import start_tiny_pipeline


@pytest.fixture(scope="session")
def http_pipeline(tiny_models, tmp_path_factory):
    """The tiny pipeline (poor draft) with the OpenAI-compatible gateway: one for every HTTP test."""
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-http"), tiny_models, "poor_draft",
                                   http_port=free_port())
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
