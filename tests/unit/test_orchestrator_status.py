"""GetStatus's parts: counters fed each round's stats, and backend probes that report failures."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.status import BackendProbes, Counters, backend_status, status
from specdec.client import _as_dict
from specdec.server.metrics import SpecDecodingStats
from specdec.v1 import common_pb2, orchestrator_pb2 as pb

ROUNDS = [SpecDecodingStats(draft_length=4, num_draft_tokens=4, num_accepted_tokens=2, num_emitted_tokens=3),
          SpecDecodingStats(draft_length=4, num_draft_tokens=4, num_accepted_tokens=0, num_emitted_tokens=1)]


def test_counters_follow_generations_as_they_run():
    counters = Counters()
    with counters.generation():
        assert counters.active_generations == 1 and counters.generations_total == 0
        for stats in ROUNDS:
            counters.observe_round(stats)
    with pytest.raises(RuntimeError), counters.generation():
        counters.observe_round(ROUNDS[0])
        raise RuntimeError("target gone")
    reply = pb.GetStatusResponse()
    counters.fill(reply)
    assert reply.active_generations == 0 and reply.generations_total == 2  # a failed one counts too
    assert reply.generated_tokens == 7 and reply.draft_tokens == 12 and reply.accepted_tokens == 4
    assert reply.acceptance_rate == pytest.approx(4 / 12)


class FakeBackend:
    def __init__(self, address, info=None, error=None):
        self.address, self._info, self._error = address, info, error

    async def info(self, timeout):
        if self._error is not None:
            raise self._error
        return self._info


class FakeRpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def test_status_probes_every_backend():
    backends = [
        ("target", FakeBackend("t:1", common_pb2.ModelInfo(model="big", kind="model", dtype="float32",
                                                           weights="gguf:q4_1+q8_0", weights_fingerprint="ab12"))),
        ("draft", FakeBackend("d:1", error=FakeRpcError())),
        ("draft", FakeBackend("d:2", error=asyncio.TimeoutError())),
    ]
    reply = asyncio.run(status(Counters(), BackendProbes(lambda: backends, 0.0), "auto"))
    assert reply.default_draft_length == "auto" and reply.version
    target, dead, slow = reply.backends
    assert (target.role, target.address, target.healthy, target.model, target.kind, target.dtype) == \
        ("target", "t:1", True, "big", "model", "float32")
    assert (target.weights, target.weights_fingerprint) == ("gguf:q4_1+q8_0", "ab12")  # what is served
    assert not dead.healthy and dead.error == "UNAVAILABLE: connection refused"
    assert not slow.healthy and slow.error.startswith("TimeoutError")


def test_backend_status_measures_the_round_trip():
    class Slow(FakeBackend):
        async def info(self, timeout):
            await asyncio.sleep(0.05)
            return common_pb2.ModelInfo(model="m")

    out = asyncio.run(backend_status("target", Slow("t:1"), 1.0))
    # asyncio may wake a sleep up to its clock's resolution early (seen in CI: 49.95 ms for 50)
    assert out.healthy and 45 <= out.rtt_ms < 1000


def test_status_dict_keeps_64_bit_numbers_as_ints():
    d = _as_dict(pb.GetStatusResponse(generations_total=5, generated_tokens=2**40,
                                      backends=[pb.BackendStatus(role="target", rtt_ms=1.5)]))
    assert d["generations_total"] == 5 and d["generated_tokens"] == 2**40
    assert d["backends"] == [{**d["backends"][0], "role": "target", "rtt_ms": 1.5, "healthy": False}]
    assert _as_dict(pb.GenerationStats(seed=2**63))["seed"] == 2**63


class CountingBackend(FakeBackend):
    """Counts its GetInfo calls; each takes a moment, so concurrent callers overlap."""

    def __init__(self, address):
        super().__init__(address, common_pb2.ModelInfo(model="m"))
        self.calls = 0

    async def info(self, timeout):
        self.calls += 1
        await asyncio.sleep(0.01)
        return self._info


def test_getstatus_asks_each_replica_at_most_once_per_interval_however_many_callers():
    backends = [("target", CountingBackend("t:1")), ("target", CountingBackend("t:2")),
                ("draft", CountingBackend("d:1"))]
    members = list(backends)
    probes = BackendProbes(lambda: members, ttl_s=60.0)

    async def burst():
        replies = await asyncio.gather(*(status(Counters(), probes, "auto") for _ in range(50)))
        for _ in range(50):
            replies.append(await status(Counters(), probes, "auto"))
        return replies

    replies = asyncio.run(burst())
    assert all([b.address for b in r.backends] == ["t:1", "t:2", "d:1"] for r in replies)
    assert [b.calls for _, b in backends] == [1, 1, 1]  # 100 GetStatus calls, one GetInfo per replica
    members.pop(1)  # a replica that left is gone at once; the others keep their recent answers
    assert [b.address for b in asyncio.run(status(Counters(), probes, "auto")).backends] == ["t:1", "d:1"]
    assert [b.calls for _, b in backends] == [1, 1, 1]
    fresh = BackendProbes(lambda: members, ttl_s=0.0)  # 0: every call asks
    asyncio.run(status(Counters(), fresh, "auto"))
    asyncio.run(status(Counters(), fresh, "auto"))
    assert [b.calls for _, b in backends] == [3, 1, 3]


def test_a_chunks_round_stats_read_as_json_format_would_without_going_through_it(monkeypatch):
    from google.protobuf.json_format import MessageToDict

    import specdec.client as client

    values = {f.name: (True if f.type == f.TYPE_BOOL else 2**40 + i if f.type == f.TYPE_UINT64 else 7 + i)
              for i, f in enumerate(pb.RoundStats.DESCRIPTOR.fields)}
    stats = pb.RoundStats(**values)
    expected = {k: int(v) if isinstance(v, str) else v
                for k, v in MessageToDict(stats, preserving_proto_field_name=True).items()}

    def refused(*args, **kwargs):
        raise AssertionError("a streamed chunk's RoundStats went through json_format")

    monkeypatch.setattr(client, "MessageToDict", refused)
    assert client._as_dict(stats) == expected == values
    assert client._as_dict(pb.RoundStats()) == dict.fromkeys(values, 0) | {"draft_fallback": False, "overlapped": False}


def test_a_draft_is_reconciled_with_its_target_by_token_ids_not_weights():
    from orchestrator.server import irreconcilable

    target = common_pb2.ModelInfo(model="m", tokenizer_fingerprint="fp", vocab_size=100, weights="gguf:q4_1+q8_0")
    copy = common_pb2.ModelInfo(model="m", tokenizer_fingerprint="fp", vocab_size=100, weights="int4g32",
                                draft_sources=["model"])
    assert irreconcilable(copy, target) == ""  # a quantized copy of the target drafts for it
    assert "different tokenizers" in irreconcilable(common_pb2.ModelInfo(tokenizer_fingerprint="other"), target)
    wider = common_pb2.ModelInfo(tokenizer_fingerprint="fp", vocab_size=128, draft_sources=["model"])
    assert "scores 128 token ids, the target 100" in irreconcilable(wider, target)
    suffix = common_pb2.ModelInfo(tokenizer_fingerprint="fp", vocab_size=128, draft_sources=["suffix"])
    assert irreconcilable(suffix, target) == ""  # no q rows to compare
