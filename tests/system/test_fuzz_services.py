"""Mutated protobuf messages against every RPC of the model services and the orchestrator's others.

The orchestrator's Generate is fuzzed field by field in test_fuzz.py; here every other RPC of the
three services (Verify, VerifyStream, ScoreTokens, Propose, ProposeStream, Release, SaveSnapshot, GetInfo, GetStatus,
CloseSession) gets messages built from valid seeds and hostile ones (token ids at and past the
vocabulary and past int32, repeated fields of 200,000 entries, grammar text of deeply nested JSON,
a logit_bias over the whole vocabulary, counts at 2^32 - 1, probability bytes of the wrong
length), then mutated as raw bytes (bits flipped, bytes replaced, truncated, unknown or repeated
fields spliced in). Properties: no call answers INTERNAL or UNKNOWN, no process dies, and once the
sessions the examples made are released, each model service caches nothing and its resident
memory is within 128 MB of where it stood after the first pass over the seeds (what is paid once:
the grammar worker's thread, the allocator's high-water mark; glibc keeps freed blocks in its
arenas, so a pass moves the figure by tens of MB either way: measured over six more passes, the
target +18 to +49 MB, the draft +11 to +72 MB).

Bounded: SPECDEC_FUZZ_SERVICE_EXAMPLES examples (300 by default), derandomized.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from specdec.launcher import free_port
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2 as opb, target_pb2, target_pb2_grpc
from tests.conftest import start_tiny_pipeline

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_SERVICE_EXAMPLES", "300"))
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
SESSIONS = [f"fuzz{i:02d}" for i in range(8)]  # the ids the seeds use, released at the end


@pytest.fixture(scope="module")
def pipeline(tiny_models, tmp_path_factory):
    p = start_tiny_pipeline(tmp_path_factory.mktemp("logs-fuzz-services"), tiny_models, "good_draft",
                            http_port=free_port())
    yield p
    p.stop()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def seeds(vocab: int, fingerprint: str) -> dict[str, list[bytes]]:
    """Valid and hostile messages per method, serialized."""
    edge = [0, 1, vocab - 1, vocab, vocab + 1, 2**31 - 1, 2**32 - 1]
    huge = list(range(200_000))
    deep = "[" * 50_000 + "]" * 50_000
    sampling = [
        common_pb2.SamplingParams(),
        common_pb2.SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
        common_pb2.SamplingParams(logit_bias={i: 5.0 for i in range(vocab)}),
        common_pb2.SamplingParams(logit_bias={2**32 - 1: 1.0, vocab: 100.0}),
        common_pb2.SamplingParams(grammar_kind="json_schema", grammar_text=deep),
        common_pb2.SamplingParams(grammar_kind="regex", grammar_text="(a{1000}){1000}"),
        common_pb2.SamplingParams(grammar_kind="lark", grammar_text=json.dumps({"a": deep})),
        common_pb2.SamplingParams(min_tokens=2**32 - 1, end_token_ids=edge, output_start=2**32 - 1),
        common_pb2.SamplingParams(constants_digest=b"\xff" * 32),
    ]
    verify, score, propose = [], [], []
    for i, s in enumerate(sampling):
        sid = SESSIONS[i % len(SESSIONS)]
        verify += [target_pb2.VerifyRequest(session_id=sid, history=[1, 2, 3], draft_tokens=[4, 5], sampling=s),
                   target_pb2.VerifyRequest(session_id=sid, history=[1, 2, 3], draft_tokens=[4, 5],
                                            draft_probs=b"\x00" * 12, sampling=s, logprobs=True, top_logprobs=5)]
        score.append(target_pb2.ScoreTokensRequest(session_id=sid, tokens=[1, 2, 3, 4], start=1, sampling=s))
        propose.append(draft_pb2.ProposeRequest(session_id=sid, history=[1, 2, 3], num_tokens=4, sampling=s,
                                                tokenizer_fingerprint=fingerprint))
    for sid in SESSIONS[:3]:
        verify += [target_pb2.VerifyRequest(session_id=sid, history=edge, draft_tokens=[1]),
                   target_pb2.VerifyRequest(session_id=sid, history=[1, 2], draft_tokens=edge),
                   target_pb2.VerifyRequest(session_id=sid, history=huge, draft_tokens=[1]),
                   target_pb2.VerifyRequest(session_id=sid, history=[1], draft_tokens=huge[:10_000]),
                   target_pb2.VerifyRequest(session_id=sid, history=[1, 2], draft_tokens=[3], top_logprobs=2**32 - 1,
                                            logprobs=True, seed=2**64 - 1),
                   target_pb2.VerifyRequest(session_id=sid, history=[1, 2], draft_tokens=[3],
                                            followers=common_pb2.Followers(tokens=huge)),
                   target_pb2.VerifyRequest(session_id=sid, history=[1, 2], followers=common_pb2.Followers(tokens=edge),
                                            continues=True)]
        score += [target_pb2.ScoreTokensRequest(session_id=sid, tokens=edge, start=0),
                  target_pb2.ScoreTokensRequest(session_id=sid, tokens=huge, start=1, top_logprobs=20),
                  target_pb2.ScoreTokensRequest(session_id=sid, tokens=[1, 2, 3], start=2**32 - 1)]
        propose += [draft_pb2.ProposeRequest(session_id=sid, history=edge, num_tokens=4,
                                             tokenizer_fingerprint=fingerprint),
                    draft_pb2.ProposeRequest(session_id=sid, history=huge, num_tokens=4,
                                             tokenizer_fingerprint=fingerprint),
                    draft_pb2.ProposeRequest(session_id=sid, history=[1, 2], num_tokens=2**32 - 1,
                                             tokenizer_fingerprint=fingerprint, corpus_group="x" * 10_000),
                    draft_pb2.ProposeRequest(session_id=sid, history=[1, 2], num_tokens=4,
                                             tokenizer_fingerprint="not-the-tokenizer")]
    ids = [common_pb2.ReleaseRequest(session_id=s) for s in SESSIONS[:2] + ["", "\x00", "x" * 100_000]]
    snapshots = [common_pb2.SaveSnapshotRequest(session_id=s) for s in SESSIONS[:2] + ["", "y" * 10_000]]
    raw = {
        "/specdec.v1.TargetService/Verify": verify,
        "/specdec.v1.TargetService/VerifyStream": verify,  # each sent twice on one call
        "/specdec.v1.TargetService/ScoreTokens": score,
        "/specdec.v1.TargetService/Release": ids,
        "/specdec.v1.TargetService/SaveSnapshot": snapshots,
        "/specdec.v1.TargetService/GetInfo": [common_pb2.GetInfoRequest()],
        "/specdec.v1.DraftService/Propose": propose,
        "/specdec.v1.DraftService/ProposeStream": propose,  # each sent twice on one call
        "/specdec.v1.DraftService/Release": ids,
        "/specdec.v1.DraftService/SaveSnapshot": snapshots,
        "/specdec.v1.DraftService/GetInfo": [common_pb2.GetInfoRequest()],
        "/specdec.v1.Orchestrator/GetStatus": [opb.GetStatusRequest()],
        "/specdec.v1.Orchestrator/CloseSession": [opb.CloseSessionRequest(session_id=s) for s in SESSIONS[:2]],
    }
    return {method: [m.SerializeToString() for m in messages] for method, messages in raw.items()}


SPLICES = st.sampled_from([
    b"\x08\xff\xff\xff\xff\x0f",  # field 1 as a varint of 2^32 - 1 (a string field given a number)
    b"\x12\x05\xff\xff\xff\xff\x0f",  # field 2, length-delimited: one packed id of 2^32 - 1
    b"\x12\xff\xff\xff\xff\x07",  # field 2 claiming 2 GB
    b"\x1a\x00", b"\xf8\x07\x07",  # an empty field 3; unknown field 127
    b"\x2a\x06\x42\x04\x00\x00\xc0\x7f",  # a nested SamplingParams with a NaN top_p
    b"\x0a\x04\xed\xa0\x80\x00",  # field 1 as invalid UTF-8 (a lone surrogate)
])


def mutated(table: dict[str, list[bytes]]):
    """Messages of `table` (method: seeds) with up to three mutations each."""
    cases = [(method, i) for method in sorted(table) for i in range(len(table[method]))]
    return st.sampled_from(range(len(cases))).flatmap(
        lambda n: _mutations(cases[n][0], table[cases[n][0]][cases[n][1]]))


@st.composite
def _mutations(draw, method: str, seed: bytes):
    raw = bytearray(seed)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["flip", "replace", "truncate", "splice", "repeat"]))
        if op == "flip" and raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "replace" and raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] = draw(st.integers(0, 255))
        elif op == "truncate" and raw:
            del raw[draw(st.integers(0, len(raw) - 1)):]
        elif op == "splice":
            at = draw(st.integers(0, len(raw)))
            raw[at:at] = draw(SPLICES)
        elif op == "repeat" and len(raw) < 4_000_000:
            raw.extend(bytes(raw))  # every field twice: repeated fields doubled, the last scalar wins
    return method, bytes(raw)


REQUESTS = {"Verify": target_pb2.VerifyRequest, "VerifyStream": target_pb2.VerifyRequest,
            "ScoreTokens": target_pb2.ScoreTokensRequest, "Propose": draft_pb2.ProposeRequest,
            "ProposeStream": draft_pb2.ProposeRequest}


def session_of(method: str, raw: bytes) -> str:
    """The session a message names, if it parses as its method's request (mutations rename some)."""
    kind = REQUESTS.get(method.rsplit("/", 1)[1])
    try:
        return kind.FromString(raw).session_id if kind else ""
    except Exception:  # noqa: BLE001 - any parse failure: the service refuses it too
        return ""


def call(channel: grpc.Channel, method: str, raw: bytes) -> grpc.StatusCode:
    try:
        if method.endswith("Stream"):  # the message twice on one call: an error ends the call
            stream = channel.stream_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for _ in stream(iter([raw, raw]), timeout=60):
                pass
        elif method.endswith("/Propose"):
            stream = channel.unary_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for _ in stream(raw, timeout=60):
                pass
        else:
            channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)(
                raw, timeout=60)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert exc.code() not in FORBIDDEN, f"{method}: {exc.code().name}: {exc.details()} for {raw[:200]!r}"
        return exc.code()


def test_every_rpc_survives_mutated_and_hostile_messages(pipeline):
    addresses = pipeline.plan.grpc_addresses()
    channels = {name: grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
                for name, address in addresses.items()}
    service_of = {"TargetService": "target", "DraftService": "draft", "Orchestrator": "orchestrator"}
    try:
        info = target_pb2_grpc.TargetServiceStub(channels["target"]).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        table = seeds(info.vocab_size, info.tokenizer_fingerprint)
        outcomes: dict[str, int] = {}
        named: set[str] = set(SESSIONS)
        started = time.monotonic()

        def seeds_as_they_are() -> None:
            for method, messages in table.items():
                for raw in messages:
                    code = call(channels[service_of[method.split("/")[1].split(".")[-1]]], method, raw)
                    outcomes[code.name] = outcomes.get(code.name, 0) + 1

        # The first pass pays what is paid once (the grammar worker's thread, the allocator's
        # high-water mark after a 200,000-token message): memory is measured from after it.
        seeds_as_they_are()
        first = {name: rss_bytes(pipeline.procs[name].pid) for name in ("target", "draft")}

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=mutated(table))
        def check(case):
            method, raw = case
            named.add(session_of(method, raw))
            code = call(channels[service_of[method.split("/")[1].split(".")[-1]]], method, raw)
            outcomes[code.name] = outcomes.get(code.name, 0) + 1

        check()
        seeds_as_they_are()
        assert all(p.poll() is None for p in pipeline.procs.values()), "a process died"
        assert outcomes.get("INVALID_ARGUMENT", 0) > 0 and outcomes.get("OK", 0) > 0, outcomes

        stubs = {"target": target_pb2_grpc.TargetServiceStub(channels["target"]),
                 "draft": draft_pb2_grpc.DraftServiceStub(channels["draft"])}
        for stub in stubs.values():
            for sid in named:
                try:
                    stub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=10)
                except grpc.RpcError as exc:  # an id no session can have
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
        grown = {}
        for name, stub in stubs.items():
            held = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
            assert (held.cached_sessions, held.cached_tokens) == (0, 0), name
            grown[name] = rss_bytes(pipeline.procs[name].pid) - first[name]
        tried = sum(outcomes.values())
        print(f"\n{tried} service messages in {time.monotonic() - started:.1f}s: {outcomes}; RSS growth {grown}")
        assert all(g < 128 << 20 for g in grown.values()), grown
    finally:
        for ch in channels.values():
            ch.close()
