"""Bad input gets a typed gRPC status whose message says what to fix, and leaks nothing."""

from __future__ import annotations

import grpc
import pytest
import redis

from specdec import Client, errors
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import orchestrator_address, start_pipeline


def _footprint(pipeline) -> tuple[int, int, int]:
    """Redis keys, target caches and draft caches: what a bad request must not leave behind."""
    plan = pipeline.plan
    keys = len(redis.Redis(port=plan.redis_port).keys("*"))
    addrs = plan.grpc_addresses()
    with grpc.insecure_channel(addrs["target"]) as t, grpc.insecure_channel(addrs["draft"]) as d:
        target = target_pb2_grpc.TargetServiceStub(t).GetInfo(common_pb2.GetInfoRequest()).cached_sessions
        draft = draft_pb2_grpc.DraftServiceStub(d).GetInfo(common_pb2.GetInfoRequest()).cached_sessions
    return keys, target, draft


CASES = [
    ("empty prompt", dict(prompt=""), errors.InvalidArgument, "prompt is empty"),
    ("prompt longer than the context", dict(prompt="x" * 600), errors.InvalidArgument, "context holds 512"),
    ("max_new_tokens zero", dict(max_new_tokens=0), errors.InvalidArgument, "max_new_tokens must be between 1"),
    ("max_new_tokens negative", dict(max_new_tokens=-3), errors.InvalidArgument, "max_new_tokens must be between 1"),
    ("max_new_tokens above the limit", dict(max_new_tokens=10**6), errors.InvalidArgument,
     "max_new_tokens must be between 1 and 4096"),
    ("negative temperature", dict(temperature=-0.5), errors.InvalidArgument, "temperature must be"),
    ("top_p zero", dict(top_p=0.0), errors.InvalidArgument, "top_p must lie in (0, 1]"),
    ("top_p above one", dict(top_p=1.5), errors.InvalidArgument, "top_p must lie in (0, 1]"),
    ("negative top_k", dict(top_k=-1), errors.InvalidArgument, "top_k must be >= 0"),
    ("draft length too large", dict(draft_length=99), errors.InvalidArgument,
     "draft_length must be -1 (auto) or between 0 and 16"),
    ("unknown session", dict(session_id="no-such-session"), errors.NotFound, "does not exist"),
]


@pytest.mark.parametrize("name,kwargs,exc_type,message", CASES, ids=[c[0] for c in CASES])
def test_bad_generate_request(tiny_pipeline, name, kwargs, exc_type, message):
    before = _footprint(tiny_pipeline)
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "Hello")
    with Client(orchestrator_address(tiny_pipeline)) as client:
        with pytest.raises(exc_type) as info:
            client.generate(prompt, **kwargs)
        with pytest.raises(exc_type):  # the streaming form fails the same way
            list(client.stream(prompt, **kwargs))
    assert message in str(info.value)
    assert _footprint(tiny_pipeline) == before


def test_target_rejects_malformed_draft_probs(tiny_pipeline):
    addrs = tiny_pipeline.plan.grpc_addresses()
    with grpc.insecure_channel(addrs["target"]) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(target_pb2.VerifyRequest(
                session_id="bad-probs", history=[5, 6], draft_tokens=[7, 8], draft_probs=b"\0" * 12,
                sampling=common_pb2.SamplingParams(temperature=1.0)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_probs holds 12 bytes" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(target_pb2.VerifyRequest(session_id="bad-token", history=[5, 10**6]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside the vocabulary" in info.value.details()


def test_draft_refuses_a_caller_with_another_tokenizer(tiny_pipeline):
    addrs = tiny_pipeline.plan.grpc_addresses()
    with grpc.insecure_channel(addrs["draft"]) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Propose(draft_pb2.ProposeRequest(session_id="s", history=[5], num_tokens=2,
                                                       tokenizer_fingerprint="0123456789abcdef")))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tokenizer mismatch" in info.value.details()


def test_orchestrator_refuses_to_start_with_mismatched_tokenizers(tiny_models, tmp_path):
    with pytest.raises(RuntimeError) as info:
        start_pipeline(tmp_path, target_model=str(tiny_models["target"]), target_dtype="float64",
                       draft_model=str(tiny_models["mismatched"]), draft_dtype="float64")
    assert "exited with code 2" in str(info.value)
    log = (tmp_path / "orchestrator.log").read_text()
    assert "different tokenizers" in log and "shares the target's tokenizer" in log


def test_orchestrator_refuses_share_outputs_with_a_draft_that_keeps_no_corpus(tiny_models, tmp_path):
    """--share-outputs named explicitly with a model draft would do nothing: refused at start."""
    with pytest.raises(RuntimeError) as info:
        start_pipeline(tmp_path, target_model=str(tiny_models["target"]), target_dtype="float64",
                       draft_model=str(tiny_models["good_draft"]), draft_dtype="float64", proposer="model",
                       extra_orchestrator_args=["--share-outputs"])
    assert "exited with code 2" in str(info.value)
    log = (tmp_path / "orchestrator.log").read_text()
    assert "--share-outputs" in log and "'model' draft, which keeps no corpus" in log
