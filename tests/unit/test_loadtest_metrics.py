"""Load-test metrics: percentiles, TPOT, ITL splitting, SLOs and goodput, speculation, summaries."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtest.metrics import (
    RequestRecord,
    Round,
    chunk_itl,
    distribution,
    itl_per_token,
    meets_slos,
    paired_speedups,
    parse_slo,
    percentile,
    speculation,
    summarize,
    tpot,
)


def record(ok=True, ttft=0.1, e2el=1.0, tokens=10, chunks=None, status="OK", **kw) -> RequestRecord:
    rec = RequestRecord("4", "c=1", "p", "chat", "grpc", 0.0, ok=ok, status=status, ttft=ttft if ok else None,
                        e2el=e2el if ok else None, output_tokens=tokens if ok else 0, **kw)
    rec.chunks = chunks if chunks is not None else []
    return rec


# -- percentile and distribution -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear_interpolation(n, q):
    rng = random.Random(n * 1000 + q)
    values = [rng.uniform(-5, 50) for _ in range(n)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_by_hand():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose: sorted 1, 2, 3, 4
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 × (4 − 3)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert values == [4.0, 1.0, 3.0, 2.0]  # the input is not sorted in place


@pytest.mark.parametrize("bad", [-1, 100.5])
def test_percentile_rejects_out_of_range_q(bad):
    with pytest.raises(ValueError):
        percentile([1.0], bad)


def test_percentile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_skips_none_and_handles_empty():
    d = distribution([1.0, None, 3.0, 2.0])
    assert d == {"count": 3, "mean": 2.0, "median": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98),
                 "min": 1.0, "max": 3.0}
    assert distribution([None]) == {"count": 0, "mean": None, "median": None, "p90": None, "p99": None,
                                    "min": None, "max": None}


# -- TPOT and ITL --------------------------------------------------------------------------------


def test_tpot_excludes_the_first_token():
    assert tpot(e2el=2.0, ttft=0.5, output_tokens=4) == pytest.approx(0.5)  # 1.5 s over 3 tokens
    assert tpot(e2el=2.0, ttft=0.5, output_tokens=1) is None
    assert tpot(e2el=2.0, ttft=0.5, output_tokens=0) is None
    assert tpot(e2el=None, ttft=0.5, output_tokens=4) is None
    assert tpot(e2el=2.0, ttft=None, output_tokens=4) is None


def test_itl_splits_each_gap_over_the_later_chunks_tokens():
    chunks = [(0.1, 1), (0.3, 2), (0.6, 1), (1.0, 4)]
    assert itl_per_token(chunks) == pytest.approx([0.1, 0.1, 0.3, 0.1, 0.1, 0.1, 0.1])
    assert chunk_itl(chunks) == pytest.approx([0.2, 0.3, 0.4])


def test_itl_counts_extra_first_chunk_tokens_as_zero():
    assert itl_per_token([(0.2, 3)]) == [0.0, 0.0]
    assert itl_per_token([(0.2, 3), (0.5, 1)]) == pytest.approx([0.0, 0.0, 0.3])
    assert itl_per_token([(0.2, 1)]) == []
    assert chunk_itl([(0.2, 3)]) == []


def test_itl_ignores_chunks_without_tokens():
    chunks = [(0.1, 1), (0.2, 0), (0.5, 2), (0.7, 0)]
    assert itl_per_token(chunks) == pytest.approx([0.2, 0.2])
    assert chunk_itl(chunks) == pytest.approx([0.4])


def test_itl_per_token_needs_token_counts_but_chunk_itl_does_not():
    http = [(0.1, None), (0.4, None), (0.5, None)]
    assert itl_per_token(http) == []
    assert chunk_itl(http) == pytest.approx([0.3, 0.1])


def test_itl_rejects_time_going_backwards():
    with pytest.raises(ValueError):
        itl_per_token([(0.5, 1), (0.4, 1)])
    with pytest.raises(ValueError):
        chunk_itl([(0.5, 1), (0.4, 1)])


def test_mean_itl_equals_tpot_when_the_stream_ends_with_its_last_chunk():
    rng = random.Random(3)
    for _ in range(50):
        t, chunks = 0.0, []
        for _ in range(rng.randint(1, 12)):
            t += rng.uniform(0.01, 0.5)
            chunks.append((t, rng.randint(1, 5)))
        n = sum(c for _, c in chunks)
        values = itl_per_token(chunks)
        assert len(values) == n - 1
        if n > 1:
            assert sum(values) / len(values) == pytest.approx(tpot(chunks[-1][0], chunks[0][0], n))


# -- SLOs and goodput ------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("ttft=0.5", ("ttft", 0.5)), ("tpot=50ms", ("tpot", 0.05)), ("E2EL = 2s", ("e2el", 2.0)),
    ("tpot=0.05", ("tpot", 0.05)),
])
def test_parse_slo(text, expected):
    name, value = parse_slo(text)
    assert (name, pytest.approx(value)) == (expected[0], expected[1])


@pytest.mark.parametrize("text", ["ttft", "itl=0.5", "ttft=fast", "ttft=0", "ttft=-1", "tpot=inf", "=1"])
def test_parse_slo_rejects(text):
    with pytest.raises(ValueError):
        parse_slo(text)


def test_meets_slos():
    rec = record(ttft=0.4, e2el=2.0, tokens=11)  # TPOT 0.16
    assert meets_slos(rec, {})
    assert meets_slos(rec, {"ttft": 0.5, "tpot": 0.2, "e2el": 2.0})  # limits are inclusive
    assert not meets_slos(rec, {"ttft": 0.3})
    assert not meets_slos(rec, {"tpot": 0.15})
    assert not meets_slos(rec, {"e2el": 1.9})
    assert meets_slos(record(ttft=0.4, e2el=0.4, tokens=1), {"tpot": 0.001})  # no TPOT: nothing to miss
    assert not meets_slos(record(ok=False, status="UNAVAILABLE"), {})  # a failure is never good


# -- speculation ------------------------------------------------------------------------------------


def test_speculation_totals_and_k_distribution():
    a = record(draft_tokens=8, accepted_tokens=6, rounds=4, fallbacks=1,
               round_stats=[Round(1.0, 4, 4, 3, False), Round(1.1, 4, 4, 3, False), Round(1.2, 4, 0, 0, True),
                            Round(1.3, 0, 0, 0, False)])
    b = record(draft_tokens=2, accepted_tokens=0, rounds=2,
               round_stats=[Round(2.0, 2, 2, 0, False), Round(2.1, 0, 0, 0, False)])
    failed = record(ok=False, status="UNAVAILABLE", draft_tokens=100, accepted_tokens=100, rounds=5,
                    round_stats=[Round(3.0, 8, 8, 8, False)])
    s = speculation([a, b, failed])
    assert s["acceptance_rate"] == pytest.approx(6 / 10)
    assert s["mean_accepted_length"] == pytest.approx((6 + 6) / 6)
    assert s["fallback_rounds"] == 1
    assert s["rounds_observed"] == 6
    assert s["k_distribution"] == {"0": 3, "2": 1, "4": 2}  # the fallback round ran at k = 0
    assert s["k0_rounds"] == 3
    assert s["k_mean"] == pytest.approx((4 + 4 + 2) / 6)


def test_speculation_without_drafting():
    s = speculation([record(rounds=5), record(ok=False, status="X")])
    assert s["acceptance_rate"] is None
    assert s["mean_accepted_length"] == 1.0
    assert s["k_distribution"] == {} and s["k_mean"] is None
    assert speculation([])["mean_accepted_length"] is None


def test_paired_speedups_match_requests_by_index():
    base = [record(e2el=2.0, tokens=10, index=0), record(e2el=1.0, tokens=10, index=1),
            record(ok=False, status="X", index=2), record(e2el=1.0, tokens=10, index=3)]
    other = [record(e2el=1.0, tokens=10, index=1), record(e2el=1.0, tokens=10, index=0),
             record(e2el=1.0, tokens=10, index=2), record(ok=False, status="X", index=3),
             record(e2el=1.0, tokens=10, index=9)]
    # index 0: 10 tok/s against 5 -> 2.0; index 1: 1.0; 2 and 3 failed on one side; 9 has no base.
    assert sorted(paired_speedups(base, other)) == pytest.approx([1.0, 2.0])
    assert paired_speedups([], other) == [] and paired_speedups(base, []) == []


# -- one run -----------------------------------------------------------------------------------------


def test_summarize_counts_throughput_goodput_and_failures():
    recs = [
        record(ttft=0.2, e2el=1.0, tokens=9, chunks=[(0.2, 1), (0.6, 4), (1.0, 4)]),
        record(ttft=0.8, e2el=3.0, tokens=12, chunks=[(0.8, 2), (3.0, 10)]),
        record(ok=False, status="UNAVAILABLE"),
        record(ok=False, status="HTTP 429"),
        record(ok=False, status="UNAVAILABLE"),
    ]
    s = summarize(recs, duration_s=4.0, slos={"ttft": 0.5})
    assert (s["requests"], s["completed"], s["failed"]) == (5, 2, 3)
    assert s["failures"] == {"HTTP 429": 1, "UNAVAILABLE": 2}
    assert s["output_tokens"] == 21
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(21 / 4)
    assert s["goodput"] == pytest.approx(0.25) and s["requests_meeting_slos"] == 1
    assert s["ttft"]["median"] == pytest.approx(0.5) and s["ttft"]["count"] == 2
    assert s["e2el"]["max"] == 3.0
    assert s["tpot"]["count"] == 2 and s["tpot"]["mean"] == pytest.approx((0.8 / 8 + 2.2 / 11) / 2)
    assert s["itl"]["count"] == 8 + 11  # n − 1 values per request
    assert s["chunk_itl"]["count"] == 3
    assert s["request_output_throughput"]["median"] == pytest.approx((9 / 1.0 + 12 / 3.0) / 2)


def test_summarize_without_slos_or_time():
    s = summarize([record()], duration_s=0.0)
    assert s["goodput"] is None and s["requests_meeting_slos"] is None
    assert s["request_throughput"] is None and s["output_throughput"] is None
    empty = summarize([], duration_s=1.0, slos={"ttft": 1})
    assert empty["completed"] == 0 and empty["goodput"] == 0 and empty["ttft"]["count"] == 0


def test_record_to_json_is_plain_data():
    import json

    rec = record(chunks=[(0.1234567891, 1)], round_stats=[Round(1.0, 4, 4, 2, False)])
    out = json.loads(json.dumps(rec.to_json()))
    assert out["chunks"] == [[0.123457, 1]] and out["k_per_round"] == [4] and "round_stats" not in out
