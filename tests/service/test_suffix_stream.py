"""A suffix draft's reader of the orchestrator's outputs stream, against a real redis-server that
requires a password (as the Helm chart's does): the password comes from $REDIS_PASSWORD, never the URL."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
import redis

from draft_service.server import SuffixStreamReader
from specdec.core.suffix import FINGERPRINT_FIELD, OUTPUT_FIELD, encode_output
from specdec.keys import suffix_outputs_key
from specdec.launcher import free_port, redis_server_binary
from specdec.runtime.proposers import SuffixProposer
from tests.conftest import wait_redis_client

PASSWORD = "s3cret-stream"


@pytest.fixture
def locked_redis(tmp_path):
    port = free_port()
    with open(tmp_path / "redis.log", "wb") as log:
        proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--requirepass", PASSWORD], stdout=log,
                                stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, password=PASSWORD)
    wait_redis_client(client, proc)
    yield port, client
    proc.terminate()
    proc.wait(10)


def _read(url: str, client: redis.Redis, caplog) -> SuffixStreamReader:
    client.xadd(suffix_outputs_key(), {OUTPUT_FIELD: encode_output([5, 6, 7, 8]), FINGERPRINT_FIELD: b"fp"})
    reader = SuffixStreamReader(SuffixProposer(), url, "fp")
    with caplog.at_level(logging.INFO, logger="draft_service.server"):
        reader.start()
        deadline = time.monotonic() + 10
        while reader.entries == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        reader.stop()
    return reader


def test_the_reader_takes_its_password_from_the_environment(locked_redis, monkeypatch, caplog):
    port, client = locked_redis
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    reader = _read(f"redis://127.0.0.1:{port}/0", client, caplog)
    assert reader.entries == 1  # the output joined the corpus
    said = [r.getMessage() for r in caplog.records if "suffix corpus: reading" in r.getMessage()]
    assert said == [f"suffix corpus: reading finished outputs from 127.0.0.1:{port}/0 (1 from its backlog)"]
    assert PASSWORD not in caplog.text


def test_without_the_password_the_reader_says_why_and_reads_nothing(locked_redis, monkeypatch, caplog):
    port, client = locked_redis
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    reader = _read(f"redis://127.0.0.1:{port}/0", client, caplog)
    assert reader.entries == 0
    assert "suffix outputs stream at" in caplog.text and "suffix corpus: reading" not in caplog.text


def test_a_password_in_the_url_wins_and_is_never_logged(locked_redis, monkeypatch, caplog):
    port, client = locked_redis
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)  # the URL's own comes first, here a wrong one
    reader = _read(f"redis://:wrong-in-url@127.0.0.1:{port}/0", client, caplog)
    assert reader.entries == 0
    assert "suffix outputs stream at 127.0.0.1" in caplog.text and "wrong-in-url" not in caplog.text
