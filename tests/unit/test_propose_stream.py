"""The orchestrator's Propose over long-lived ProposeStream calls, against real gRPC servers on free
ports: a call reused round after round with each request's time limit, a block wanted token by
token (drafted ahead) sent as a Propose call, failures read as a Propose call's, the sampling
constants sent again to a replica that lost them, and a replica without ProposeStream sent Propose
calls. (What the stream machinery shares with VerifyStream, a call that times out, is cancelled or
outlived its replica, is tested in test_verify_stream.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from orchestrator.backends import DraftBackend, DraftReleased, DraftUnavailable
from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, FailedPrecondition
from specdec.server.constants import MissingConstants, SessionConstants
from specdec.server.serving import default_interceptors
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

C = grpc.StatusCode
PARAMS = SamplingParams(temperature=0.7, logit_bias=((5, -2.0),))


class Draft(draft_pb2_grpc.DraftServiceServicer):
    """A draft that proposes 4, 5, 6 (as many as asked), or fails with `code`; counts the calls each
    RPC was opened and what each request carried."""

    def __init__(self, code: grpc.StatusCode | None = None, stream: bool = True,
                 followers: list[int] | None = None) -> None:
        self.code = code
        self.stream = stream
        self.followers = followers  # listed with every block when set
        self.opened = {"Propose": 0, "ProposeStream": 0}
        self.held = SessionConstants()
        self.carried: list[str] = []
        self.timeouts: list[int] = []

    async def _proposals(self, request, context) -> list[draft_pb2.Proposal]:
        msg = request.sampling
        self.carried.append("digest" if msg.constants_digest and not msg.logit_bias else "full")
        self.timeouts.append(request.timeout_ms)
        if self.code is not None:
            await context.abort(self.code, "boom")
        try:
            self.held.resolve(request.session_id, msg)
        except MissingConstants as exc:
            await context.abort(C.NOT_FOUND, str(exc))
        return [draft_pb2.Proposal(token_id=4 + i, index=i, compute_ns=100, source=draft_pb2.DRAFT_SOURCE_SUFFIX)
                for i in range(min(3, request.num_tokens))]

    async def GetInfo(self, request, context):
        return common_pb2.ModelInfo(caches_sampling_constants=True)

    async def Propose(self, request, context):
        self.opened["Propose"] += 1
        for proposal in await self._proposals(request, context):
            yield proposal

    async def ProposeStream(self, requests, context):
        if not self.stream:  # a replica of an earlier version
            await context.abort(C.UNIMPLEMENTED, "Method not found!")
        self.opened["ProposeStream"] += 1
        async for request in requests:
            block = draft_pb2.ProposeBlock(proposals=await self._proposals(request, context))
            if self.followers is not None:
                block.followers.SetInParent()
                block.followers.tokens.extend(self.followers)
            yield block


@contextlib.asynccontextmanager
async def backend_of(draft: Draft) -> AsyncIterator[DraftBackend]:
    """`draft` served on a free port, and a client of it (ProposeStream on); both closed after."""
    server = grpc.aio.server(interceptors=default_interceptors())
    draft_pb2_grpc.add_DraftServiceServicer_to_server(draft, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    backend = DraftBackend(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        yield backend
    finally:
        await backend.close()
        await server.stop(None)


async def propose(backend: DraftBackend, session: str = "s", k: int = 3, timeout: float | None = None,
                  progress: asyncio.Event | None = None):
    return await backend.propose(session, [1, 2], k, PARAMS, 0, "fp", timeout=timeout, progress=progress)


async def test_one_call_carries_every_round_and_each_request_its_time_limit():
    draft = Draft()
    async with backend_of(draft) as backend:
        replies = [await propose(backend) for _ in range(4)]
        assert all(r.tokens == [4, 5, 6] and r.source == "suffix" and r.compute_ns == 300 for r in replies)
        assert (await propose(backend, k=1, timeout=2.5)).tokens == [4]
        assert draft.opened == {"Propose": 0, "ProposeStream": 1}
        assert draft.timeouts == [10_000] * 4 + [2500]
        await asyncio.gather(*(propose(backend, f"c{i}") for i in range(3)))  # a call each, given back
        await asyncio.gather(*(propose(backend, f"c{i}") for i in range(3)))
        assert draft.opened == {"Propose": 0, "ProposeStream": 3}
        # a block taken token by token as it comes (drafted ahead) is a Propose call of its own
        progress = asyncio.Event()
        assert (await propose(backend, progress=progress)).tokens == [4, 5, 6] and progress.is_set()
        assert draft.opened == {"Propose": 1, "ProposeStream": 3}


@pytest.mark.parametrize("listed, read", [(None, None), ([], frozenset()), ([9, 3], frozenset({3, 9})),
                                          (list(range(257)), None)])
async def test_a_blocks_followers_are_read_unless_a_target_would_refuse_them(listed, read):
    """ProposeBlock.followers: unset is not listed, an empty list is a list, and a draft that lists
    more than a target takes (256) counts as not listing any (never a verify that fails for it)."""
    async with backend_of(Draft(followers=listed)) as backend:
        assert (await propose(backend)).followers == read
        assert (await propose(backend, progress=asyncio.Event())).followers is None  # (a Propose call lists none)


@pytest.mark.parametrize("code, timeout, error, message", [
    (C.FAILED_PRECONDITION, None, FailedPrecondition, "^boom$"),  # the request's fault: passed on
    (C.CANCELLED, None, DraftReleased, "^boom$"),
    (C.DEADLINE_EXCEEDED, 1.0, DeadlineExceeded, "deadline passed while the draft proposed"),
    (C.DEADLINE_EXCEEDED, None, DraftUnavailable, "^DEADLINE_EXCEEDED: boom$"),
    (C.UNAVAILABLE, None, DraftUnavailable, "^UNAVAILABLE: boom$"),
])
async def test_a_failure_on_the_stream_reads_as_a_propose_calls(code, timeout, error, message):
    draft = Draft(code)
    async with backend_of(draft) as backend:
        with pytest.raises(error, match=message):
            await propose(backend, timeout=timeout)
        draft.code = None  # the failed call is not reused: the next round opens another
        assert (await propose(backend)).tokens == [4, 5, 6]
        assert draft.opened == {"Propose": 0, "ProposeStream": 2}


async def test_a_replica_that_lost_the_constants_gets_them_again_on_the_stream():
    draft = Draft()
    async with backend_of(draft) as backend:
        await backend.info()
        for _ in range(3):
            assert (await propose(backend)).tokens == [4, 5, 6]
        draft.held = SessionConstants()  # restarted: the digest is answered NOT_FOUND, then the full set goes
        assert (await propose(backend)).tokens == [4, 5, 6]
        assert draft.carried == ["full", "digest", "digest", "digest", "full"]


async def test_a_replica_without_propose_stream_gets_propose_calls():
    draft = Draft(stream=False)
    async with backend_of(draft) as backend:
        assert [(await propose(backend)).tokens for _ in range(3)] == [[4, 5, 6]] * 3
        assert not backend.stream and draft.opened["Propose"] == 3
