"""A suffix draft's reader of the orchestrator's outputs stream, against a real redis-server that
requires a password (as the Helm chart's does): the password comes from $REDIS_PASSWORD, never the URL."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from draft_service.server import SuffixStreamCollector, SuffixStreamReader
from specdec.core.sampling import SamplingParams
from specdec.core.suffix import FINGERPRINT_FIELD, OUTPUT_FIELD, encode_output
from specdec.keys import suffix_outputs_key
from specdec.launcher import free_port, redis_server_binary
from specdec.runtime.proposers import SuffixProposer
from specdec.server.redis import RedisSettings
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
    reader = SuffixStreamReader(SuffixProposer(), RedisSettings.from_url(url), "fp")
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
    assert said == [f"suffix corpus: reading finished outputs from redis at redis://127.0.0.1:{port}/0 "
                    "(1 from its backlog)"]
    assert PASSWORD not in caplog.text


def test_without_the_password_the_reader_says_why_and_reads_nothing(locked_redis, monkeypatch, caplog):
    port, client = locked_redis
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    reader = _read(f"redis://127.0.0.1:{port}/0", client, caplog)
    assert reader.entries == 0
    assert "suffix outputs stream (" in caplog.text and "suffix corpus: reading" not in caplog.text


def test_a_password_in_the_url_wins_and_is_never_logged(locked_redis, monkeypatch, caplog):
    port, client = locked_redis
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)  # the URL's own comes first, here a wrong one
    reader = _read(f"redis://:wrong-in-url@127.0.0.1:{port}/0", client, caplog)
    assert reader.entries == 0
    assert "suffix outputs stream (redis at redis://127.0.0.1" in caplog.text and "wrong-in-url" not in caplog.text


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_bad_entries_are_skipped_and_counted_and_the_reader_keeps_reading(locked_redis, monkeypatch):
    """An entry the reader cannot use (not UTF-8 where text is expected, a length that is no multiple of
    4, a token id past the vocabulary or past int32) is skipped and counted; the entries after it
    still join the corpus, and no id the target would refuse is ever proposed."""
    port, client = locked_redis
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    key = suffix_outputs_key()
    vocab = 100
    bad = [
        {OUTPUT_FIELD: encode_output([5, 6, 7, 8]), FINGERPRINT_FIELD: b"\xff\xfe"},  # not UTF-8
        {OUTPUT_FIELD: encode_output([5, 6, 7]) + b"\x01"},  # 13 bytes
        {OUTPUT_FIELD: encode_output([1, 2, 3, 2**31 + 5])},  # past int32
        {OUTPUT_FIELD: encode_output([1, 2, 3, vocab + 1, 4])},  # past the vocabulary
    ]
    for fields in bad[:2]:
        client.xadd(key, fields)  # in the backlog
    proposer = SuffixProposer(min_match=2)
    reader = SuffixStreamReader(proposer, RedisSettings.from_url(f"redis://127.0.0.1:{port}/0"), "fp", vocab_size=vocab)
    reader.start()
    try:
        for fields in bad[2:]:
            client.xadd(key, fields)  # read live
        client.xadd(key, {OUTPUT_FIELD: encode_output([1, 2, 3, 9, 10, 11])})
        assert _wait_for(lambda: reader.entries == 1), (reader.entries, reader.skipped)
        assert reader._thread.is_alive()
        assert reader.skipped == {"malformed": 2, "other_tokenizer": 0, "out_of_vocabulary": 2, "empty": 0}
        registry = CollectorRegistry()
        registry.register(SuffixStreamCollector("draft", reader))
        exported = generate_latest(registry).decode()
        assert 'specdec_suffix_stream_skipped_total{reason="out_of_vocabulary",service="draft"} 2.0' in exported
        assert 'specdec_suffix_stream_entries_total{service="draft"} 1.0' in exported
        assert list(proposer.propose("s", [1, 2, 3], 4, SamplingParams(), 0))  # the good entry serves
        assert all(d.token_id < vocab for d in proposer.propose("t", [7, 1, 2, 3], 4, SamplingParams(), 0))
    finally:
        reader.stop()
