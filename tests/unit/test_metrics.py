"""Metrics: the orchestrator's vLLM-style metrics, the services' metrics, and the HTTP endpoint."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specdec.server.metrics import OrchestratorMetrics, ServiceMetrics, SpecDecodingStats, serve_metrics
from specdec.v1 import orchestrator_pb2


def samples(registry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(registry, name: str, **labels) -> float:
    return samples(registry).get((name, tuple(sorted(labels.items()))), 0.0)


def test_orchestrator_round_and_request_metrics():
    m = OrchestratorMetrics()
    rounds = [
        orchestrator_pb2.RoundStats(draft_length=4, proposed=4, accepted=2, draft_ns=30_000_000,
                                    draft_compute_ns=20_000_000, verify_ns=150_000_000, verify_compute_ns=120_000_000),
        orchestrator_pb2.RoundStats(draft_length=4, proposed=4, accepted=4, verify_ns=100_000_000,
                                    verify_compute_ns=90_000_000, draft_ns=10_000_000, draft_compute_ns=5_000_000),
        orchestrator_pb2.RoundStats(draft_length=0, verify_ns=80_000_000, verify_compute_ns=70_000_000,
                                    draft_fallback=True),
    ]
    with m.start_request() as timer:
        assert value(m.registry, "specdec_num_requests_running", service="orchestrator") == 1
        for stats, n in zip(rounds, (3, 5, 1)):
            m.observe_round(SpecDecodingStats.of_round(stats, n))
            time.sleep(0.01)
            timer.observe_chunk(n)
        timer.observe_finish("length", prompt_tokens=7, completion_tokens=9)
    r, o = m.registry, {"service": "orchestrator"}
    assert value(r, "specdec_spec_decode_num_drafts_total", **o) == 2
    assert value(r, "specdec_spec_decode_num_draft_tokens_total", **o) == 8
    assert value(r, "specdec_spec_decode_num_accepted_tokens_total", **o) == 6
    per_pos = [value(r, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **o)
               for i in range(4)]
    assert per_pos == [2, 2, 1, 1]
    assert value(r, "specdec_spec_decode_draft_length_count", **o) == 3
    assert value(r, "specdec_spec_decode_draft_length_sum", **o) == 8
    assert value(r, "specdec_draft_fallbacks_total", **o) == 1
    assert value(r, "specdec_round_trip_seconds_count", backend="target", **o) == 3
    assert abs(value(r, "specdec_round_trip_seconds_sum", backend="target", **o) - 0.05) < 1e-9
    assert abs(value(r, "specdec_backend_compute_seconds_sum", backend="draft", **o) - 0.025) < 1e-9
    assert value(r, "specdec_time_to_first_token_seconds_count", **o) == 1
    assert value(r, "specdec_inter_token_latency_seconds_count", **o) == 2
    assert value(r, "specdec_time_per_output_token_seconds_count", **o) == 1
    assert value(r, "specdec_e2e_request_latency_seconds_count", **o) == 1
    assert value(r, "specdec_request_success_total", finish_reason="length", **o) == 1
    assert value(r, "specdec_generation_tokens_total", **o) == 9
    assert value(r, "specdec_num_requests_running", **o) == 0


def test_a_request_left_by_an_exception_is_counted_and_no_longer_running():
    m = OrchestratorMetrics()
    try:
        with m.start_request():
            raise RuntimeError("backend down")
    except RuntimeError:
        pass
    assert value(m.registry, "specdec_request_success_total", service="orchestrator", finish_reason="error") == 1
    assert value(m.registry, "specdec_num_requests_running", service="orchestrator") == 0


def test_service_metrics_are_scraped_over_http():
    m = ServiceMetrics("target")
    m.track(running=lambda: 3, waiting=lambda: 5, kv_sessions=lambda: 2, kv_tokens=lambda: 117)
    m.on_step(4, 0.12)
    m.on_start(0.003)
    m.on_dropped("deadline")
    m.on_reject()
    port, stop = serve_metrics(m.registry, "127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        stop()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    t = (("service", "target"),)
    assert got[("specdec_num_requests_running", t)] == 3
    assert got[("specdec_num_requests_waiting", t)] == 5
    assert got[("specdec_kv_cache_sessions", t)] == 2
    assert got[("specdec_kv_cache_tokens", t)] == 117
    assert got[("specdec_batch_size_sum", t)] == 4
    assert got[("specdec_compute_seconds_count", t)] == 1
    assert got[("specdec_queue_wait_seconds_count", t)] == 1
    assert got[("specdec_admission_rejections_total", t)] == 1
    assert got[("specdec_requests_dropped_total", (("reason", "deadline"), ("service", "target")))] == 1
    assert got[("specdec_requests_dropped_total", (("reason", "cancelled"), ("service", "target")))] == 0


async def test_orchestrator_metrics_follow_an_admission_counter():
    import asyncio

    import pytest

    from specdec.server.admission import Admission, Overloaded

    m = OrchestratorMetrics()
    admission = Admission(max_concurrent=1, max_queued=0, name="orchestrator")
    m.track_admission(admission)
    gate = asyncio.Event()

    async def hold():
        async with admission.slot():
            await gate.wait()

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0.01)
    assert value(m.registry, "specdec_num_requests_running", service="orchestrator") == 1
    with pytest.raises(Overloaded):
        async with admission.slot():
            pass
    assert value(m.registry, "specdec_admission_rejections_total", service="orchestrator") == 1
    gate.set()
    await holder
    assert value(m.registry, "specdec_num_requests_running", service="orchestrator") == 0
