"""Property-based fuzzing of the public APIs against ONE running pipeline (tiny models, real Redis).

gRPC: every field of `GenerateRequest` is written as raw protobuf bytes, so the examples include
what no client library would send: invalid UTF-8 and lone surrogates in strings, control
characters, NaN/inf/subnormal floats, negative and 64-bit varints in 32-bit fields, unknown and
repeated fields, truncated messages, and session_id / resume_from combinations (none, a real
session, an unknown one, garbage). Properties: the orchestrator never answers INTERNAL or UNKNOWN,
never dies, and a refused request leaves no key in Redis; an accepted one leaves exactly its
session, which CloseSession removes.

HTTP: JSON bodies for /v1/completions and /v1/chat/completions (valid-looking and not, plus raw
bytes): never a 5xx, always an OpenAI error object when refused.

Bounded: a fixed number of examples (SPECDEC_FUZZ_EXAMPLES to run more), derandomized so CI runs
the same cases every time, and `--max-new-tokens-limit 8` so accepted generations are short.
"""

from __future__ import annotations

import json
import os
import struct
import time
import urllib.error
import urllib.request

import grpc
import pytest
import redis
from hypothesis import HealthCheck, example, given, settings, strategies as st

from specdec.launcher import free_port
from specdec.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc
from tests.conftest import orchestrator_address, start_tiny_pipeline

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "200"))
HTTP_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_HTTP_EXAMPLES", "250"))
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
SESSION_KEYS = "specdec:v1:{*"


@pytest.fixture(scope="module")
def pipeline(tiny_models, tmp_path_factory):
    p = start_tiny_pipeline(tmp_path_factory.mktemp("logs-fuzz"), tiny_models, "poor_draft", draft_length="auto",
                            http_port=free_port(),
                            extra_orchestrator_args=["--max-new-tokens-limit", "8", "--default-max-new-tokens", "4",
                                                     "--max-stop-strings", "4",
                                                     # every fuzzed close reaches the checks, not the rate limit
                                                     "--max-closes-per-s", "0"])
    yield p
    p.stop()


@pytest.fixture(scope="module")
def store(pipeline):
    r = redis.Redis(host=pipeline.plan.host, port=pipeline.plan.redis_port)
    yield r
    r.close()


@pytest.fixture(scope="module")
def channel(pipeline):
    ch = grpc.insecure_channel(orchestrator_address(pipeline))
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def known_session(channel) -> str:
    """A real session the examples may try to continue or resume."""
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    chunks = list(stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=4), timeout=60))
    return chunks[0].session_id


# -- raw protobuf -------------------------------------------------------------------------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative numbers as their 64-bit two's complement, as protobuf does
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def field_float(number: int, value: float) -> bytes:
    return varint(number << 3 | 5) + struct.pack("<f", value)


PROMPT_FIELD = field_bytes(1, b"Once upon a time") + field_varint(3, 8)
CONTROL = st.characters(codec=None, categories=("Cc", "Cf", "Zl", "Zp"))
strings = st.one_of(
    st.text(max_size=40).map(str.encode),
    st.text(alphabet=CONTROL, max_size=20).map(str.encode),
    st.binary(max_size=40),  # mostly invalid UTF-8
    st.text(alphabet=st.characters(codec=None, categories=("Cs",)), min_size=1, max_size=4)  # lone surrogates
    .map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"", b"Once upon a time", "héllo wörld 日本語 🙂".encode(), b"\x00" * 8, b"a" * 600]),
)
ints = st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(0, 2**64 - 1), st.sampled_from([0, 1, -1, 8, 9, 2**31 - 1,
                                                                                              -2**31, 2**32, 2**63]))
floats = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 0.5, 1.0, 1.0000001, 3.4e38]))
roles = st.one_of(st.sampled_from([b"system", b"user", b"assistant"]), strings)
message = st.tuples(st.none() | roles, st.none() | strings).map(
    lambda rc: (field_bytes(1, rc[0]) if rc[0] is not None else b"")
    + (field_bytes(2, rc[1]) if rc[1] is not None else b""))
messages = st.lists(message, max_size=4).map(lambda ms: b"".join(field_bytes(1, m) for m in ms))


def mostly(valid, hostile):
    """Valid values five times in six, so enough requests get through and go deep."""
    return st.integers(0, 5).flatmap(lambda n: hostile if n == 0 else valid)


valid_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1,
                     max_size=30).map(str.encode)
valid_message = st.tuples(st.sampled_from([b"system", b"user", b"assistant"]), valid_text).map(
    lambda rc: field_bytes(1, rc[0]) + field_bytes(2, rc[1]))
VALID = {3: st.integers(1, 8), 6: st.integers(0, 50), 7: st.integers(0, 2**64 - 1), 9: st.integers(-1, 8),
         4: st.floats(0, 2, width=32), 5: st.floats(0.0625, 1, width=32)}


@st.composite
def generate_requests(draw, known: str):
    parts = []
    which = draw(mostly(st.sampled_from(["prompt", "messages"]), st.sampled_from(["both", "none"])))
    if which in ("prompt", "both"):
        parts.append(field_bytes(1, draw(mostly(valid_text, strings))))
    if which in ("messages", "both"):
        valid_messages = st.lists(valid_message, min_size=1, max_size=3).map(
            lambda ms: b"".join(field_bytes(1, m) for m in ms))
        parts.append(field_bytes(2, draw(mostly(valid_messages, messages))))
    for number in (3, 6, 7, 9):  # max_new_tokens, top_k, seed, draft_length
        if draw(st.booleans()):
            parts.append(field_varint(number, draw(mostly(VALID[number], ints))))
    for number in (4, 5):  # temperature, top_p
        if draw(st.booleans()):
            parts.append(field_float(number, draw(mostly(VALID[number], floats))))
    for stop in draw(mostly(st.lists(valid_text, max_size=2), st.lists(strings, max_size=6))):
        parts.append(field_bytes(8, stop))
    session = draw(mostly(st.just("none"), st.sampled_from(["known", "unknown", "garbage"])))
    if session == "known":
        parts.append(field_bytes(10, known.encode()))
    elif session == "unknown":
        parts.append(field_bytes(10, b"0123456789abcdef0123456789abcdef"))
    elif session == "garbage":
        parts.append(field_bytes(10, draw(strings)))
    if draw(st.integers(0, 5)) == 0:
        parts.append(field_varint(11, draw(mostly(st.integers(0, 8), ints))))  # resume_from
    if draw(st.integers(0, 9)) == 0:
        parts.append(field_varint(99, 7))  # an unknown field
    parts = draw(st.permutations(parts))
    raw = b"".join(parts)
    if draw(st.integers(0, 14)) == 0:
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]  # truncated mid-field
    if draw(st.integers(0, 19)) == 0:
        raw = draw(st.binary(max_size=64))  # not a message at all
    return raw


def _session_keys(store) -> set[bytes]:
    return set(store.scan_iter(SESSION_KEYS, count=1000))


def test_grpc_requests_never_crash_leak_or_answer_internal(pipeline, channel, store, known_session):
    generate = channel.unary_stream("/specdec.v1.Orchestrator/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateChunk.FromString)
    unary = channel.unary_unary("/specdec.v1.Orchestrator/GenerateUnary", request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)
    close = orchestrator_pb2_grpc.OrchestratorStub(channel).CloseSession
    outcomes: dict[str, int] = {}
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(raw=generate_requests(known_session), streaming=st.booleans())
    @example(raw=PROMPT_FIELD + field_float(4, 1e-45), streaming=True)  # subnormal temperature: logits overflow
    @example(raw=PROMPT_FIELD + field_float(4, 3.4e38), streaming=True)
    @example(raw=PROMPT_FIELD + field_float(4, 1.0) + field_float(5, 1e-45), streaming=True)
    @example(raw=PROMPT_FIELD + field_float(4, 1.0) + field_varint(6, 2**31 - 1), streaming=False)
    @example(raw=PROMPT_FIELD + field_varint(7, 2**64 - 1) + field_float(4, 0.7), streaming=True)
    @example(raw=PROMPT_FIELD + field_varint(9, 8) + field_float(4, 0.9) + field_float(5, 0.0625), streaming=True)
    @example(raw=field_bytes(1, b"\x00\x01\x02\x7f"), streaming=True)
    def check(raw: bytes, streaming: bool):
        before = _session_keys(store)
        session = ""
        try:
            if streaming:
                for chunk in generate(raw, timeout=60):
                    session = session or chunk.session_id
            else:
                session = unary(raw, timeout=60).session_id
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            assert code not in FORBIDDEN, f"{code.name}: {exc.details()} for {raw!r}"
        outcomes[code.name] = outcomes.get(code.name, 0) + 1
        after = _session_keys(store)
        if session and session != known_session:
            new = {k for k in after - before if session.encode() in k}
            assert new, f"accepted request {raw!r} left no session"
            assert close(pb.CloseSessionRequest(session_id=session), timeout=30).closed
            after = _session_keys(store)
        assert after == before, f"{code.name} for {raw!r} left keys {after - before}"

    check()
    assert all(p.poll() is None for p in pipeline.procs.values()), "a process died"
    assert outcomes.get("INVALID_ARGUMENT", 0) > 0 and outcomes.get("OK", 0) > 0, outcomes
    print(f"\n{EXAMPLES} gRPC examples in {time.monotonic() - started:.1f}s: {outcomes}")


def test_close_session_with_any_id_is_never_internal(channel, store):
    close = channel.unary_unary("/specdec.v1.Orchestrator/CloseSession", request_serializer=lambda b: b,
                                response_deserializer=pb.CloseSessionResponse.FromString)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @given(sid=strings)
    def check(sid: bytes):
        before = _session_keys(store)
        try:
            close(field_bytes(1, sid), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT,), f"{exc.code().name}: {exc.details()}"
        assert _session_keys(store) == before

    check()


# -- HTTP ---------------------------------------------------------------------------------------


def _post(url: str, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                         st.text(max_size=30))
json_values = st.recursive(json_scalars,
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=8)


@st.composite
def http_bodies(draw, model: str):
    chat = draw(st.booleans())
    body: dict = {}
    if draw(st.integers(0, 19)):
        body["model"] = draw(mostly(st.just(model), json_values))
    short = st.text(max_size=30)
    stop_text = st.text(min_size=1, max_size=8)
    if chat:
        msg = st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "user", "assistant", "developer"]),
                                                    json_values),
                                     "content": mostly(short, json_values)})
        body["messages"] = draw(mostly(st.lists(msg, min_size=1, max_size=3), json_values))
    else:
        body["prompt"] = draw(mostly(short.filter(bool), st.lists(st.text(max_size=10), max_size=2) | json_values))
    body["max_tokens"] = draw(mostly(st.integers(1, 4), st.integers(-5, 20) | json_values))
    for key, valid, hostile in (
            ("temperature", st.floats(0, 2), st.floats() | json_values),
            ("top_p", st.floats(0.01, 1), st.floats() | json_values),
            ("top_k", st.integers(0, 50), st.integers(-2, 2**40) | json_values),
            ("seed", st.integers(0, 2**64 - 1), st.integers(-1, 2**65) | json_values),
            ("stop", stop_text | st.lists(stop_text, max_size=2), json_values), ("n", st.just(1), st.integers(0, 3)),
            ("stream", st.booleans(), json_values),
            ("draft_length", st.integers(-1, 8) | st.just("auto"), st.integers(-3, 40) | json_values),
            ("session_id", st.just(""), st.text(max_size=40) | json_values), ("logprobs", st.just(None), json_values)):
        if draw(st.booleans()):
            body[key] = draw(mostly(valid, hostile))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body, allow_nan=True).encode()
    if draw(st.integers(0, 14)) == 0:
        raw = draw(st.binary(max_size=80))  # not JSON, or not UTF-8
    return path, raw


def test_http_bodies_never_give_a_server_error(pipeline):
    base = pipeline.plan.http_url()
    with urllib.request.urlopen(f"{base}/models", timeout=30) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    statuses: dict[int, int] = {}

    @settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=http_bodies(model))
    def check(case):
        path, raw = case
        status, body = _post(base.removesuffix("/v1") + path, raw)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, f"{status} for {path} {raw!r}: {body[:300]!r}"
        if status != 200 and not body.startswith(b"data:"):
            error = json.loads(body)["error"]
            assert error["message"] and error["type"], error

    check()
    assert all(p.poll() is None for p in pipeline.procs.values()), "a process died"
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses
    print(f"\n{HTTP_EXAMPLES} HTTP examples: {statuses}")
