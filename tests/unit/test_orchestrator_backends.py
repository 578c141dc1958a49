"""How the orchestrator's clients read a failed call to a draft or target replica (no network:
the stubs are replaced), and what a verify reply emits."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.backends import (
    Busy,
    DraftBackend,
    DraftReleased,
    DraftReply,
    DraftUnavailable,
    Released,
    TargetBackend,
    VerifyReply,
)
from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from specdec.v1 import target_pb2

C = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str = "boom") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FailingStub:
    def __init__(self, code: grpc.StatusCode) -> None:
        self.error = rpc_error(code)

    def Propose(self, request, timeout=None):
        async def stream():
            raise self.error
            yield  # an async generator, as a streaming call is

        return stream()

    async def Verify(self, request, timeout=None):
        raise self.error


async def propose(code: grpc.StatusCode, timeout: float | None = None) -> None:
    backend = DraftBackend("127.0.0.1:1", timeout_s=10.0, stream=False)  # a Propose call a round
    backend.stub = FailingStub(code)
    try:
        await backend.propose("s", [1, 2], 3, SamplingParams(), 0, "fp", timeout=timeout)
    finally:
        await backend.close()


async def verify(code: grpc.StatusCode, timeout: float | None = None) -> None:
    backend = TargetBackend("127.0.0.1:1", timeout_s=10.0, stream=False)  # a Verify call a round
    backend.stub = FailingStub(code)
    try:
        await backend.verify("s", [1, 2], DraftReply(tokens=[3]), SamplingParams(), 0, timeout=timeout)
    finally:
        await backend.close()


@pytest.mark.parametrize("code, timeout, error, message", [
    (C.FAILED_PRECONDITION, None, FailedPrecondition, "^boom$"),  # the request's fault: passed on
    (C.CANCELLED, None, DraftReleased, "^boom$"),  # the session was released: the replica is fine
    (C.DEADLINE_EXCEEDED, 1.0, DeadlineExceeded, "deadline passed while the draft proposed"),
    (C.DEADLINE_EXCEEDED, None, DraftUnavailable, "^DEADLINE_EXCEEDED: boom$"),  # the draft's own limit
    (C.DEADLINE_EXCEEDED, 20.0, DraftUnavailable, "^DEADLINE_EXCEEDED: boom$"),
    (C.UNAVAILABLE, None, DraftUnavailable, "^UNAVAILABLE: boom$"),
    (C.INVALID_ARGUMENT, None, DraftUnavailable, "^INVALID_ARGUMENT: boom$"),
])
async def test_a_draft_failure_falls_back_unless_it_is_the_requests(code, timeout, error, message):
    with pytest.raises(error, match=message) as caught:
        await propose(code, timeout)
    assert isinstance(caught.value, DraftUnavailable) == (error in (DraftReleased, DraftUnavailable))


@pytest.mark.parametrize("code, timeout, error, message", [
    (C.INVALID_ARGUMENT, None, InvalidArgument, "^boom$"),
    (C.CANCELLED, None, Released, "^boom$"),
    (C.DEADLINE_EXCEEDED, 1.0, DeadlineExceeded, "deadline passed while the target verified"),
    (C.DEADLINE_EXCEEDED, None, Busy, r"^127.0.0.1:1 did not answer within 10.0s$"),  # slow or dead: the pool asks
    (C.RESOURCE_EXHAUSTED, None, Busy, r"^127.0.0.1:1 is overloaded: boom$"),
    (C.FAILED_PRECONDITION, None, Unavailable, r"failed \(FAILED_PRECONDITION: boom\)"),
    (C.UNAVAILABLE, None, Unavailable, r"failed \(UNAVAILABLE: boom\)"),
])
async def test_a_target_failure_is_unavailable_unless_it_is_the_requests(code, timeout, error, message):
    with pytest.raises(error, match=message) as caught:
        await verify(code, timeout)
    assert not isinstance(caught.value, Released) or error is Released
    assert isinstance(caught.value, Busy) == (error is Busy)  # Busy is an Unavailable the pool looks into


def test_a_verify_reply_emits_the_accepted_draft_prefix_then_the_targets_token():
    assert VerifyReply(2, 9, False, 0, 0).emitted([4, 5, 6]) == [4, 5, 9]  # recovered at the third
    assert VerifyReply(3, 9, True, 0, 0).emitted([4, 5, 6]) == [4, 5, 6, 9]  # bonus
    assert VerifyReply(0, 9, True, 0, 0).emitted([]) == [9]  # k = 0: plain decoding
    assert VerifyReply(0, 9, True, 0, 0, decoded=[7, 8]).emitted([]) == [9, 7, 8]  # k = 0, decode_steps 3


class AnsweringStub:
    """Answers every Verify with `reply`."""

    def __init__(self, reply: target_pb2.VerifyResponse) -> None:
        self.reply = reply

    async def Verify(self, request, timeout=None):
        return self.reply


@pytest.mark.parametrize("drafts, steps, decoded, refused", [
    ([], 4, [7, 8, 9], False),
    ([], 4, [7, 8, 9, 10], True),  # more than asked
    ([], 1, [7], True),
    ([3], 1, [7], True),  # further passes after a block
])
async def test_a_target_answering_more_passes_than_asked_is_unavailable(drafts, steps, decoded, refused):
    backend = TargetBackend("127.0.0.1:1", timeout_s=10.0, stream=False)
    backend.stub = AnsweringStub(target_pb2.VerifyResponse(token_id=5, decoded=decoded))
    try:
        if refused:
            with pytest.raises(Unavailable, match="further tokens"):
                await backend.verify("s", [1, 2], DraftReply(tokens=drafts), SamplingParams(), 0, decode_steps=steps)
        else:
            reply = await backend.verify("s", [1, 2], DraftReply(tokens=drafts), SamplingParams(), 0,
                                         decode_steps=steps)
            assert reply.emitted(drafts) == [5, *decoded]
    finally:
        await backend.close()
