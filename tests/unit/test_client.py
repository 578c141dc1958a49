"""The SDK's pure parts: request building, chunk conversion, failure classification, resume bookkeeping."""

from __future__ import annotations

import json

import grpc
import pytest

from specdec import errors
from specdec.client import (
    Deadline,
    Endpoints,
    StreamRun,
    build_request,
    channel_options,
    chunk_from_pb,
    connection_lost,
    is_header,
)
from specdec.v1 import orchestrator_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_build_request_sets_only_what_is_given():
    req = build_request("Hi", max_new_tokens=8, stop="\n", draft_length="auto", seed=0)
    assert req.prompt == "Hi" and req.max_new_tokens == 8 and list(req.stop) == ["\n"]
    assert req.draft_length == -1 and req.HasField("seed") and req.seed == 0
    assert not req.HasField("temperature") and not req.HasField("top_p") and not req.HasField("resume_from")
    chat = build_request(messages=[{"role": "user", "content": "Yo"}], session_id="s1", draft_length="3")
    assert chat.WhichOneof("input") == "messages" and chat.messages.messages[0].content == "Yo"
    assert chat.session_id == "s1" and chat.draft_length == 3
    with pytest.raises(ValueError, match="exactly one"):
        build_request()
    with pytest.raises(ValueError, match="exactly one"):
        build_request("x", messages=[])


def test_chunk_conversion_and_header_detection():
    header = pb.GenerateChunk(session_id="s", offset=4)
    assert is_header(header)
    msg = pb.GenerateChunk(session_id="s", token_ids=[5, 6], text="ab", offset=4,
                           round=pb.RoundStats(draft_length=4, proposed=4, accepted=1))
    assert not is_header(msg)
    chunk = chunk_from_pb(msg)
    assert ((chunk.token_ids, chunk.text, chunk.offset, chunk.finish_reason, chunk.stats)
            == ([5, 6], "ab", 4, None, None))
    assert chunk.round["proposed"] == 4 and chunk.round["accepted"] == 1
    last = pb.GenerateChunk(session_id="s", finish_reason=pb.FINISH_REASON_EOS, stats=pb.GenerationStats(rounds=3))
    assert not is_header(last)  # a content-free last chunk still carries the end and the stats
    assert chunk_from_pb(last).finish_reason == "eos" and chunk_from_pb(last).stats["rounds"] == 3


@pytest.mark.parametrize("code,details,lost", [
    (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", True),
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
    (grpc.StatusCode.UNKNOWN, "Stream removed", True),
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", True),
    (grpc.StatusCode.UNKNOWN, "Exception iterating responses: boom", False),
    (grpc.StatusCode.ABORTED, "session is busy", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty", False),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False),
    (grpc.StatusCode.CANCELLED, "Socket closed", False),
])
def test_connection_lost(code, details, lost):
    assert connection_lost(FakeRpcError(code, details)) is lost


def test_idempotent_calls_get_a_retry_policy():
    options = dict(channel_options())
    config = json.loads(options["grpc.service_config"])
    (method_config,) = config["methodConfig"]
    assert {n["method"] for n in method_config["name"]} == {"GetStatus", "CloseSession"}
    assert "Generate" not in json.dumps(method_config["name"])  # a stream is resumed, not replayed
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert options["grpc.enable_retries"] == 1


def test_endpoints_rotate():
    ep = Endpoints("a:1, b:2,c:3")
    assert ep.addresses == ["a:1", "b:2", "c:3"]
    assert [ep.first() for _ in range(4)] == [0, 1, 2, 0]
    assert ep.order() == ["b:2", "c:3", "a:1"]
    assert ep.next(2) == 0
    with pytest.raises(ValueError):
        Endpoints([])


def _run(resume=True, addresses=("a:1", "b:2"), max_attempts=5) -> StreamRun:
    return StreamRun(build_request("Hi", max_new_tokens=9), Endpoints(list(addresses)), resume=resume,
                     deadline=Deadline(None), max_attempts=max_attempts, initial_backoff_s=0.1, max_backoff_s=1.0)


def test_resume_after_a_drop_asks_for_the_rest_on_the_next_address():
    run = _run()
    assert run.address == "a:1" and run.next_request().prompt == "Hi"
    assert run.accept(pb.GenerateChunk(session_id="s1")) is None  # header
    assert run.accept(pb.GenerateChunk(session_id="s1", token_ids=[1, 2, 3], text="abc")).text == "abc"
    error, wait = run.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert error is None and wait == 0.0 and run.address == "b:2"
    req = run.next_request()
    assert req.session_id == "s1" and req.resume_from == 3 and req.WhichOneof("input") is None
    assert run.resumes == 1
    with pytest.raises(errors.Internal, match="resumed session s1 at token 2, but the client holds 3"):
        run.accept(pb.GenerateChunk(session_id="s1", token_ids=[3], offset=2))


def test_a_second_drop_resumes_from_the_new_count_and_backs_off_on_a_known_address():
    run = _run()
    run.accept(pb.GenerateChunk(session_id="s1", token_ids=[1]))  # an old server: no header
    assert run.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE))[0] is None
    run.accept(pb.GenerateChunk(session_id="s1", token_ids=[2, 3], offset=1))
    error, wait = run.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE))
    assert error is None and wait == pytest.approx(0.2)  # both addresses tried once: pause
    assert run.address == "a:1" and run.next_request().resume_from == 3 and run.resumes == 2


def test_a_drop_before_any_chunk_sends_the_original_request_again():
    run = _run(resume=False)
    error, _ = run.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert error is None and run.next_request().prompt == "Hi" and run.resumes == 0


def test_no_resume_when_the_caller_opts_out_or_attempts_run_out():
    run = _run(resume=False)
    run.accept(pb.GenerateChunk(session_id="s1"))
    error, _ = run.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert isinstance(error, errors.Unavailable) and "orchestrator a:1" in str(error)
    run = _run(max_attempts=2)
    assert run.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE))[0] is None
    assert isinstance(run.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE))[0], errors.Unavailable)


@pytest.mark.parametrize("code,exc_type", [
    (grpc.StatusCode.ABORTED, errors.Aborted), (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded), (grpc.StatusCode.NOT_FOUND, errors.NotFound),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
])
def test_other_failures_are_raised_typed_and_not_retried(code, exc_type):
    run = _run()
    run.accept(pb.GenerateChunk(session_id="s1", token_ids=[1]))
    error, _ = run.failed(FakeRpcError(code, "why"))
    assert type(error) is exc_type and error.code == code.name and str(error) == "orchestrator a:1: why"
    assert error.address == "a:1"
