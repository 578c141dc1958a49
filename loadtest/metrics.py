"""Load-test metrics: pure functions over per-request records, no I/O.

Definitions follow vLLM's `bench serve` and GuideLLM. Times are seconds on the client's clock.

Per request
- **TTFT** (time to first token): from sending the request to the arrival of the first chunk
  that carries output tokens.
- **E2EL** (end-to-end latency): from sending the request to the end of its stream.
- **TPOT** (time per output token, the first excluded): `(E2EL − TTFT) / (output_tokens − 1)`;
  undefined (None) for a one-token output.
- **ITL** (inter-token latency), *per token*: the gap between two consecutive chunks is divided
  evenly across the tokens of the later chunk (a chunk of `n` tokens arriving `g` seconds after
  the one before contributes `n` values `g / n`); tokens that came in the first chunk after the
  first token contribute 0 (they arrived with it). A request of `n` tokens gives `n − 1` values
  whose mean is `(t_last_chunk − t_first_chunk) / (n − 1)`, i.e. TPOT when the stream ends with
  its last chunk. Speculative decoding delivers several tokens per chunk, so the per-chunk gaps
  are reported as well: **chunk ITL**, one value per streamed chunk after the first (what
  vLLM's `bench serve` records as ITL). Over HTTP the tokens of an event are unknown: there only
  chunk ITL is measured.

Per run (one mode at one load)
- **duration**: the wall time of the run's phases (first request sent to last response ended).
- **request throughput**: completed requests / duration; **output token throughput**: output
  tokens of completed requests / duration.
- **goodput**: completed requests that met every SLO / duration (vLLM's `--goodput`); SLOs on
  `ttft`, `tpot` and `e2el`, in seconds. A request without a TPOT (one token) meets a TPOT SLO.
- **failures** by status: the gRPC status name (`UNAVAILABLE`, ...) or `HTTP <code>`.
- **first vs rest TTFT** (sessions sharing a system prompt): `ttft_first_s`, the median over
  phases of the TTFT of each phase's first request, and `ttft_rest_median_s`, the median TTFT
  of the phases' other requests: the cost of a cold shared prefix against a warm one.
- Latency distributions: mean, median, p90, p99 (percentiles by linear interpolation between
  closest ranks, numpy's default), plus min, max and count.

Speculation (ours; `k` is the draft length of a round)
- **acceptance rate**: accepted draft tokens / proposed draft tokens.
- **mean accepted length**: tokens emitted per round, `(accepted + rounds) / rounds` (each round
  emits its accepted tokens plus the target's own), as `GenerationStats.mean_accepted_length`.
- **k distribution**: rounds per `k` actually run, a fallback round counting at 0 (gRPC only:
  from the per-chunk round stats); `k_mean` is its mean.
- **fallback rounds**: rounds whose draft failed (`draft_fallback`, run at k = 0; from the
  generation totals, so over HTTP too); **k = 0 rounds**: rounds run without drafting, chosen or
  fallen back.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_METRICS = ("ttft", "tpot", "e2el")
BASELINE = "0"  # the mode the others are compared with: plain decoding


@dataclass
class Round:
    """One speculative round as the client saw it (a streamed gRPC chunk)."""

    at: float  # when its chunk arrived, seconds since the run started
    k: int  # draft length requested for the round
    proposed: int
    accepted: int
    fallback: bool  # the draft failed and the round ran at k = 0


@dataclass
class RequestRecord:
    """Everything measured about one request."""

    mode: str  # the draft length sent: "0", "4", "auto", ...
    load: str  # label of the load level, e.g. "c=2" or "1.5 req/s"
    prompt_id: str
    kind: str  # workload kind: chat, grounded, code
    api: str  # grpc or http
    start: float  # when it was sent, seconds since the run started
    phase: int = 0
    index: int = -1  # position in the load level's request sequence: the same prompt in every mode
    turn: int = 0  # the turn of a multi-turn session (0: its first request)
    shared_output: bool = False  # its output could join the suffix drafts' corpus (the prompt's last send)
    ok: bool = False
    status: str = "OK"  # "OK", a gRPC status name or "HTTP <code>"
    error: str = ""
    ttft: float | None = None
    e2el: float | None = None
    # (seconds since the request was sent, tokens in the chunk; None when unknown, as over HTTP)
    chunks: list[tuple[float, int | None]] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    # Totals of the generation, as the server reported them at the end.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    fallbacks: int = 0
    resumes: int = 0  # times the SDK resumed a broken stream (gRPC)
    round_stats: list[Round] = field(default_factory=list)  # gRPC only

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("round_stats", "chunks")}
        out["chunks"] = [[round(t, 6), n] for t, n in self.chunks]
        out["k_per_round"] = [r.k for r in self.round_stats]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RequestRecord:
        """A record back from `to_json` (the per-round stats are not kept there, only k per round)."""
        names = set(cls.__dataclass_fields__) - {"chunks", "round_stats"}
        rec = cls(**{k: v for k, v in obj.items() if k in names})
        rec.chunks = [(t, n) for t, n in obj.get("chunks", [])]
        return rec


# -- single values --------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    h = (len(ordered) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """mean, median, p90, p99, min, max and count of the values that are not None."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    return {"count": len(vals), "mean": sum(vals) / len(vals), "median": percentile(vals, 50),
            "p90": percentile(vals, 90), "p99": percentile(vals, 99), "min": min(vals), "max": max(vals)}


def tpot(e2el: float | None, ttft: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2EL − TTFT) / (n − 1); None for n < 2."""
    if e2el is None or ttft is None or output_tokens < 2:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def _token_chunks(chunks: Sequence[tuple[float, int | None]]) -> list[tuple[float, int | None]]:
    """Chunks that carry output (a chunk with 0 tokens adds nothing; None means unknown, not 0)."""
    return [(t, n) for t, n in chunks if n is None or n > 0]


def itl_per_token(chunks: Sequence[tuple[float, int | None]]) -> list[float]:
    """Per-token inter-token latencies: each chunk gap divided across the later chunk's tokens.

    `chunks`: (arrival time, tokens) in arrival order. Tokens of the first chunk after its first
    one count 0 (they arrived with it). Empty when a chunk's token count is unknown.
    """
    chunks = _token_chunks(chunks)
    if not chunks or any(n is None for _, n in chunks):
        return []
    out = [0.0] * (chunks[0][1] - 1)
    for (prev, _), (t, n) in zip(chunks, chunks[1:]):
        if t < prev:
            raise ValueError("chunk times must not decrease")
        out.extend([(t - prev) / n] * n)
    return out


def chunk_itl(chunks: Sequence[tuple[float, int | None]]) -> list[float]:
    """Per-chunk inter-token latencies: the gaps between consecutive output-carrying chunks."""
    times = [t for t, _ in _token_chunks(chunks)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    if any(g < 0 for g in gaps):
        raise ValueError("chunk times must not decrease")
    return gaps


# -- SLOs and goodput -------------------------------------------------------------------------------


def parse_slo(text: str) -> tuple[str, float]:
    """`ttft=0.5` (seconds) or `tpot=50ms` -> ("ttft", 0.5) / ("tpot", 0.05)."""
    name, sep, value = text.partition("=")
    name = name.strip().lower()
    if not sep or name not in SLO_METRICS:
        raise ValueError(f"an SLO is METRIC=SECONDS with METRIC one of {', '.join(SLO_METRICS)}; got {text!r}")
    value = value.strip().lower()
    scale = 1.0
    if value.endswith("ms"):
        value, scale = value[:-2], 1e-3
    elif value.endswith("s"):
        value = value[:-1]
    try:
        limit = float(value) * scale
    except ValueError:
        raise ValueError(f"the limit of {text!r} is not a number of seconds") from None
    if not limit > 0 or math.isinf(limit):
        raise ValueError(f"the limit of {text!r} must be a positive number of seconds")
    return name, limit


def request_values(rec: RequestRecord) -> dict[str, float | None]:
    """The SLO-able values of one request."""
    return {"ttft": rec.ttft, "tpot": tpot(rec.e2el, rec.ttft, rec.output_tokens), "e2el": rec.e2el}


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request whose every SLO metric is within its limit (a missing TPOT passes)."""
    if not rec.ok:
        return False
    values = request_values(rec)
    for name, limit in slos.items():
        value = values[name]
        if value is None and name == "tpot":
            continue
        if value is None or value > limit:
            return False
    return True


# -- speculation ------------------------------------------------------------------------------------


def speculation(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Acceptance, tokens per round, k chosen and fallbacks over the completed requests."""
    done = [r for r in records if r.ok]
    drafted = sum(r.draft_tokens for r in done)
    accepted = sum(r.accepted_tokens for r in done)
    rounds = sum(r.rounds for r in done)
    per_round = [x for r in done for x in r.round_stats]
    k_counts = Counter(x.k if not x.fallback else 0 for x in per_round)
    return {
        "draft_tokens": drafted, "accepted_tokens": accepted, "rounds": rounds,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
        "fallback_rounds": sum(r.fallbacks for r in done),
        # Per-round views exist only where the rounds were streamed (gRPC).
        "rounds_observed": len(per_round),
        "k_distribution": {str(k): k_counts[k] for k in sorted(k_counts)},
        "k_mean": sum(x.k for x in per_round if not x.fallback) / len(per_round) if per_round else None,
        "k0_rounds": k_counts.get(0, 0),
    }


def paired_speedups(base: Sequence[RequestRecord], other: Sequence[RequestRecord]) -> list[float]:
    """Per request sent in both runs (same `index` and `turn`: same prompt, close in time): the other run's
    output tokens per second of latency over the base run's. Their median is a side-by-side ratio
    that machine noise between blocks does not move much."""
    def rate(r: RequestRecord) -> float | None:
        return r.output_tokens / r.e2el if r.ok and r.e2el and r.output_tokens else None

    by_index = {(r.index, r.turn): rate(r) for r in base}
    out = []
    for r in other:
        b, o = by_index.get((r.index, r.turn)), rate(r)
        if b and o:
            out.append(o / b)
    return out


def first_vs_rest_ttft(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT of each phase's first request (the first sent) against the others of its phase.

    For sessions sharing a system prompt that is new to every phase: the first pays its prefill,
    the later ones may reuse it. `ttft_first_s`: the median over phases of the first request's TTFT
    (a phase whose first request failed has none); `ttft_rest_median_s`: the median TTFT of the
    phases' other completed requests (None when no phase had more than one).
    """
    phases: dict[int, list[RequestRecord]] = {}
    for r in records:
        phases.setdefault(r.phase, []).append(r)
    first: list[float] = []
    rest: list[float] = []
    for recs in phases.values():
        head, *tail = sorted(recs, key=lambda r: (r.start, r.index, r.turn))
        if head.ok and head.ttft is not None:
            first.append(head.ttft)
        rest += [r.ttft for r in tail if r.ok and r.ttft is not None]
    return {"ttft_first_s": percentile(first, 50) if first else None,
            "ttft_rest_median_s": percentile(rest, 50) if rest else None,
            "ttft_first_count": len(first), "ttft_rest_count": len(rest)}


# -- one run -----------------------------------------------------------------------------------------


def summarize(records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """All metrics of one mode at one load; `duration_s` is the wall time its requests took."""
    slos = slos or {}
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    good = sum(meets_slos(r, slos) for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return {
        "requests": len(records), "completed": len(done), "failed": len(failed),
        "failures": dict(sorted(Counter(r.status for r in failed).items())),
        "duration_s": duration_s,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "goodput": per_s(good) if slos else None,
        "requests_meeting_slos": good if slos else None,
        "slos": dict(slos),
        "ttft": distribution(r.ttft for r in done),
        "tpot": distribution(tpot(r.e2el, r.ttft, r.output_tokens) for r in done),
        "itl": distribution(x for r in done for x in itl_per_token(r.chunks)),
        "chunk_itl": distribution(x for r in done for x in chunk_itl(r.chunks)),
        "e2el": distribution(r.e2el for r in done),
        "request_output_throughput": distribution(
            r.output_tokens / r.e2el for r in done if r.e2el and r.output_tokens),
        "speculation": speculation(records),
    }
