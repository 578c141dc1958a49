"""A generation's logit_bias and grammar travel once per session and replica: the model service
keeps them (`specdec.server.constants`), the orchestrator's clients send their digest alone after
the first call, and send them again when a replica says it lost them (no network: stubs)."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.backends import DraftBackend, DraftReply, TargetBackend
from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.server.constants import MissingConstants, SessionConstants
from specdec.server.wire import constants_digest, sampling_to_pb
from specdec.v1 import common_pb2, draft_pb2, target_pb2

PARAMS = SamplingParams(temperature=0.5, logit_bias=((5, -100.0), (7, 2.5)), grammar_kind="regex",
                        grammar_text="(yes|no)")
PLAIN = SamplingParams(temperature=0.5)


def test_the_digest_is_the_same_on_both_ends_and_names_only_the_constants():
    wire = sampling_to_pb(PARAMS)
    digest = constants_digest(PARAMS)
    assert len(digest) == 32 and wire.constants_digest == digest
    again = SamplingParams(temperature=0.9, logit_bias=tuple(wire.logit_bias.items()), grammar_kind=wire.grammar_kind,
                           grammar_text=wire.grammar_text)
    assert constants_digest(again) == digest  # what the service rebuilds from the wire; temperature is not in it
    assert constants_digest(PLAIN) == b"" and not sampling_to_pb(PLAIN).constants_digest
    for other in (SamplingParams(logit_bias=((5, -99.0), (7, 2.5)), grammar_kind="regex", grammar_text="(yes|no)"),
                  SamplingParams(logit_bias=PARAMS.logit_bias, grammar_kind="regex", grammar_text="(yes|nope)")):
        assert constants_digest(other) != digest
    lean = sampling_to_pb(PARAMS, constants=False)
    assert lean.constants_digest == digest and not lean.logit_bias and not lean.grammar_text


def test_a_service_keeps_them_per_session_and_fills_them_in():
    held = SessionConstants()
    assert held.resolve("s", sampling_to_pb(PARAMS), vocab_size=100) == PARAMS
    assert held.resolve("s", sampling_to_pb(PARAMS, constants=False), vocab_size=100) == PARAMS
    assert held.resolve("s", sampling_to_pb(PLAIN)) == PLAIN  # a new generation without any
    with pytest.raises(MissingConstants) as info:  # another session never sees them
        held.resolve("t", sampling_to_pb(PARAMS, constants=False))
    assert info.value.code == "NOT_FOUND"
    held.release("s")
    with pytest.raises(MissingConstants):
        held.resolve("s", sampling_to_pb(PARAMS, constants=False))
    assert len(held) == 0 and held.bytes == 0


def test_a_digest_that_does_not_match_what_came_with_it_is_refused():
    wire = sampling_to_pb(PARAMS)
    wire.constants_digest = b"\0" * 32
    with pytest.raises(InvalidArgument, match="constants_digest does not match"):
        SessionConstants().resolve("s", wire)


def test_memory_is_bounded_least_recently_used_first():
    big = [SamplingParams(grammar_kind="regex", grammar_text=f"(a{i}|" + "b" * 4000 + ")") for i in range(10)]
    held = SessionConstants(max_bytes=20_000)
    for i, params in enumerate(big):
        held.resolve(f"s{i}", sampling_to_pb(params))
    assert held.bytes <= 20_000 and len(held) < 10
    assert held.resolve("s9", sampling_to_pb(big[9], constants=False)) == big[9]
    with pytest.raises(MissingConstants):
        held.resolve("s0", sampling_to_pb(big[0], constants=False))


class ServiceStub:
    """A model service's Verify and Propose over `SessionConstants`, recording what each call carried."""

    def __init__(self) -> None:
        self.held = SessionConstants()
        self.carried: list[str] = []  # "full", "digest" or "none" per call

    def _receive(self, request) -> SamplingParams:
        msg = request.sampling
        self.carried.append("none" if not msg.constants_digest else "full" if msg.grammar_text else "digest")
        try:
            return self.held.resolve(request.session_id, msg)
        except MissingConstants as exc:
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=str(exc)) from None

    async def Verify(self, request, timeout=None):
        assert self._receive(request) == PARAMS
        return target_pb2.VerifyResponse(num_accepted=0, token_id=9)

    def Propose(self, request, timeout=None):
        async def stream():
            assert self._receive(request) == PARAMS
            yield draft_pb2.Proposal(token_id=4)

        return stream()

    async def GetInfo(self, request, timeout=None, wait_for_ready=None):
        return common_pb2.ModelInfo(caches_sampling_constants=True)

    async def Release(self, request, timeout=None):
        self.held.release(request.session_id)
        return common_pb2.ReleaseResponse(released=True)


async def verify(backend: TargetBackend, session: str = "s"):
    return await backend.verify(session, [1, 2], DraftReply(), PARAMS, 0)


async def test_the_target_gets_them_once_per_session_then_their_digest():
    backend = TargetBackend("127.0.0.1:1", timeout_s=10.0, stream=False)
    stub = backend.stub = ServiceStub()
    try:
        await verify(backend)  # before any GetInfo: sent whole (the replica may be one that keeps none)
        await backend.info()
        for _ in range(3):
            await verify(backend)
        await verify(backend, "other")
        assert stub.carried == ["full", "digest", "digest", "digest", "full"]
        stub.held = SessionConstants()  # the replica restarted: it answers NOT_FOUND, and gets them again
        assert (await verify(backend)).token_id == 9
        assert stub.carried[-2:] == ["digest", "full"]
        await verify(backend)
        await backend.release("s")  # a released session starts over
        await verify(backend)
        assert stub.carried[-2:] == ["digest", "full"]
    finally:
        await backend.close()


async def test_the_draft_gets_them_once_per_session_then_their_digest():
    backend = DraftBackend("127.0.0.1:1", timeout_s=10.0, stream=False)
    stub = backend.stub = ServiceStub()
    try:
        await backend.info()
        for _ in range(3):
            assert (await backend.propose("s", [1, 2], 1, PARAMS, 0, "fp")).tokens == [4]
        stub.held = SessionConstants()
        assert (await backend.propose("s", [1, 2], 1, PARAMS, 0, "fp")).tokens == [4]
        assert stub.carried == ["full", "digest", "digest", "digest", "full"]
    finally:
        await backend.close()


async def test_a_replica_that_does_not_keep_them_gets_them_every_time():
    backend = TargetBackend("127.0.0.1:1", timeout_s=10.0, stream=False)
    stub = backend.stub = ServiceStub()

    async def old_info(request, timeout=None, wait_for_ready=None):
        return common_pb2.ModelInfo()  # a replica of an earlier version: it would ignore the digest

    stub.GetInfo = old_info
    try:
        await backend.info()
        for _ in range(3):
            await verify(backend)
        assert stub.carried == ["full"] * 3
    finally:
        await backend.close()
