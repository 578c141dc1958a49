"""Python SDK for the orchestrator's public API: `Client` (blocking) and `AsyncClient` (asyncio).

    from specdec import Client
    with Client("127.0.0.1:50051") as client:
        out = client.generate("Once upon a time", max_new_tokens=32)
        print(out.text, out.stats["acceptance_rate"])
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}]):
            print(chunk.text, end="", flush=True)

Both clients share everything but the I/O: request building (`build_request`), chunk
conversion (`chunk_from_pb`), the resume bookkeeping of a stream (`StreamRun`), address
rotation (`Endpoints`) and channel settings (`channel_options`).

Failure handling, in one list:
- Every failed call raises a `specdec.errors` type (mapped from the gRPC status in
  `specdec.rpc_errors.from_rpc_error`); the message names the orchestrator address.
- Several addresses: new calls go round-robin over them; a call that finds one UNAVAILABLE
  tries the next.
- Idempotent calls (GetStatus, CloseSession) are retried by gRPC itself on UNAVAILABLE, with
  exponential backoff, through the retry policy in the channel's service config.
- A stream that breaks (UNAVAILABLE, or the connection dropped: the orchestrator died) is
  resumed on the next address with `session_id` and `resume_from` = the tokens already received,
  so the caller sees every token exactly once; `resume=False` turns that off. A stream that
  breaks before anything arrived is simply sent again (nothing was delivered). ABORTED (the
  session is busy), bad input and deadlines are never retried.
- `timeout` is a deadline for the whole call, resumes included.

Security: `token=` sends `authorization: Bearer <token>` with every call (each call may pass
its own); `tls_ca=` (and `tls_cert=`/`tls_key=` for mutual TLS) or `credentials=` use TLS. A
failed authentication raises `specdec.errors.Unauthenticated`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from specdec.channel import CHANNEL_OPTIONS, inject
from specdec.errors import Internal, SpecdecError
from specdec.rpc_errors import from_rpc_error
from specdec.v1 import common_pb2, orchestrator_pb2 as pb, orchestrator_pb2_grpc

SERVICE = "specdec.v1.Orchestrator"
DEFAULT_ADDRESS = "127.0.0.1:50051"

FINISH_REASONS = {pb.FINISH_REASON_UNSPECIFIED: None, pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop"}

# gRPC retries these calls on its own (safe to repeat: reading status, deleting a session).
RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
IDEMPOTENT_METHODS = ("GetStatus", "CloseSession")

# How older and newer gRPC releases report a connection that died under a stream.
_DROPPED = re.compile(r"stream removed|socket closed|rst_stream|connection reset|broken pipe|goaway|end of file",
                      re.IGNORECASE)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata of one call: the bearer token, the current trace context and request id."""
    carrier: dict[str, str] = {}
    if token:
        carrier["authorization"] = f"Bearer {token}"
    inject(carrier)
    return tuple(carrier.items())


def tls_credentials(ca: str | bytes | None = None, cert: str | bytes | None = None,
                    key: str | bytes | None = None) -> grpc.ChannelCredentials:
    """TLS credentials from PEM paths or bytes: `ca` to verify the server (None: the system's roots),
    `cert` + `key` to prove the client (mutual TLS)."""
    def pem(value: str | bytes | None) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        with open(value, "rb") as f:
            return f.read()

    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together")
    return grpc.ssl_channel_credentials(root_certificates=pem(ca), private_key=pem(key), certificate_chain=pem(cert))


def channel_options(extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """Our message-size limits plus a service config that retries the idempotent calls."""
    config = {"methodConfig": [{
        "name": [{"service": SERVICE, "method": m} for m in IDEMPOTENT_METHODS],
        "retryPolicy": RETRY_POLICY,
    }]}
    return [*CHANNEL_OPTIONS, ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config)), *extra]


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


_INTEGRAL = _INT64 | {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_SINT32,
                      FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_BOOL}


@functools.cache
def _plain_fields(descriptor) -> tuple[str, ...] | None:
    """The field names of a message type whose fields are all single integers or booleans (RoundStats,
    in every streamed chunk), which read as they are; None for any other type."""
    fields = descriptor.fields
    if all(f.type in _INTEGRAL and not f.is_repeated and not f.has_presence for f in fields):
        return tuple(f.name for f in fields)
    return None


def _as_dict(msg) -> dict[str, Any]:
    """A message as a dict of plain values (64-bit integers stay ints, unlike proto3 JSON's strings)."""
    plain = _plain_fields(msg.DESCRIPTOR)
    if plain is not None:  # what MessageToDict gives, at a tenth of its cost
        return {name: getattr(msg, name) for name in plain}
    out = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for f in msg.DESCRIPTOR.fields:
        if f.name not in out:
            continue
        repeated = f.is_repeated
        if f.type in _INT64:
            out[f.name] = [int(v) for v in out[f.name]] if repeated else int(out[f.name])
        elif f.message_type is not None and not f.message_type.GetOptions().map_entry:
            value = getattr(msg, f.name)
            out[f.name] = [_as_dict(v) for v in value] if repeated else _as_dict(value)
    return out


# -- results ------------------------------------------------------------------------------------


@dataclass
class Logprob:
    """A generated token's log-probability under the target, its rank at its position, and the most
    likely (token id, log-probability) alternatives there, most likely first."""

    token_id: int
    token: str  # its text, decoded alone
    logprob: float
    rank: int
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token id, text, logprob)


def logprob_from_pb(msg: common_pb2.TokenLogprobs) -> Logprob:
    return Logprob(msg.token_id, msg.token, msg.logprob, msg.rank,
                   list(zip(msg.top_token_ids, msg.top_tokens, msg.top_logprobs)))


@dataclass
class Chunk:
    """One streamed round: new tokens, the text they add and the round's statistics."""

    session_id: str
    token_ids: list[int]
    text: str  # text delta (may lag the tokens by a partial character or a possible stop-string prefix)
    round: dict[str, Any]  # RoundStats: draft_length, proposed, accepted, draft_ns, verify_ns, ...
    finish_reason: str | None = None  # "length", "eos" or "stop" on the last chunk
    stats: dict[str, Any] | None = None  # GenerationStats of the whole generation, on the last chunk
    offset: int = 0  # position of the first token within the generation
    logprobs: list[Logprob] = field(default_factory=list)  # one per token of token_ids, when asked
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # one per input token (the first: rank 0)


@dataclass
class Generation:
    """A finished generation."""

    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict[str, Any] = field(default_factory=dict)
    resumes: int = 0  # how often the stream was resumed after a broken connection
    logprobs: list[Logprob] = field(default_factory=list)  # one per token of token_ids, when asked
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # one per input token (the first: rank 0)


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict[str, str]] | None = None,
                  max_new_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: str | Sequence[str] | None = (), draft_length: int | str | None = None,
                  session_id: str = "", min_p: float | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                  logit_bias: dict[int, float] | None = None, min_tokens: int | None = None,
                  ignore_eos: bool = False, stop_token_ids: Sequence[int] = (), logprobs: bool = False,
                  top_logprobs: int | None = None, prompt_logprobs: bool = False,
                  grammar: tuple[str, str] | None = None, tools: Sequence[dict] | None = None,
                  share_output: bool | None = None) -> pb.GenerateRequest:
    """A `GenerateRequest`; unset (None) values take the server's defaults. `prompt` is text, or token
    ids used as they are. `grammar`: (kind, text) the output must follow, e.g. ("json_schema", schema
    as JSON), ("regex", pattern), ("choice", a JSON list), ("json_object", ""). `tools`: OpenAI's tool
    list, for the chat template (messages may carry OpenAI's `tool_calls`, and `tool` messages their
    `tool_call_id` and `name`). `share_output=False` keeps the output out of the corpus that
    suffix-speculation drafts learn from (unset: the server's --share-outputs)."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt or messages")
    if isinstance(draft_length, str):
        draft_length = -1 if draft_length == "auto" else int(draft_length)  # -1 selects the controller
    if isinstance(stop, str):
        stop = [stop]
    req = pb.GenerateRequest(stop=list(stop or ()), session_id=session_id or "", ignore_eos=ignore_eos,
                             stop_token_ids=list(stop_token_ids), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             logit_bias={int(t): float(b) for t, b in (logit_bias or {}).items()})
    if grammar is not None:
        req.grammar.kind, req.grammar.text = grammar
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(int(t) for t in prompt)
    else:
        req.messages.messages.extend(_chat_message(m) for m in messages)
        if tools:
            req.messages.tools_json = json.dumps(list(tools))
    if tools and messages is None:
        raise ValueError("tools go with chat messages, not a raw prompt")
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed), ("draft_length", draft_length), ("min_p", min_p),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("min_tokens", min_tokens),
                        ("top_logprobs", top_logprobs), ("share_output", share_output)):
        if value is not None:
            setattr(req, name, value)
    return req


def _chat_message(m: dict) -> pb.ChatMessage:
    msg = pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id") or "",
                         name=m.get("name") or "")
    if m.get("tool_calls"):
        msg.tool_calls_json = json.dumps(m["tool_calls"])
    return msg


def chunk_from_pb(msg: pb.GenerateChunk) -> Chunk:
    return Chunk(msg.session_id, list(msg.token_ids), msg.text, _as_dict(msg.round),
                 FINISH_REASONS[msg.finish_reason], _as_dict(msg.stats) if msg.HasField("stats") else None,
                 msg.offset, [logprob_from_pb(entry) for entry in msg.logprobs],
                 [logprob_from_pb(entry) for entry in msg.prompt_logprobs])


def is_header(msg: pb.GenerateChunk) -> bool:
    """The content-free first chunk that only announces the session id."""
    return (not msg.token_ids and not msg.text and msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED
            and not msg.HasField("stats") and not msg.prompt_logprobs)


def status_from_pb(msg: pb.GetStatusResponse, address: str) -> dict[str, Any]:
    """GetStatus as a plain dict (JSON-ready), with the address that answered."""
    return {"address": address, **_as_dict(msg)}


class Collector:
    """Adds up the chunks of a stream into a `Generation`."""

    def __init__(self) -> None:
        self.session_id = ""
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[Logprob] = []
        self.prompt_logprobs: list[Logprob] = []
        self.finish_reason: str | None = None
        self.stats: dict[str, Any] = {}

    def add(self, chunk: Chunk) -> None:
        self.session_id = chunk.session_id or self.session_id
        self.text.append(chunk.text)
        self.tokens.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.stats is not None:
            self.stats = chunk.stats

    def result(self, resumes: int) -> Generation:
        return Generation(self.session_id, "".join(self.text), self.tokens, self.finish_reason, self.stats, resumes,
                          self.logprobs, self.prompt_logprobs)


# -- the logic both clients share ---------------------------------------------------------------


def typed_error(exc: grpc.RpcError, address: str) -> SpecdecError:
    """The SDK's exception for a failed call, its message naming the orchestrator."""
    err = from_rpc_error(exc)
    named = type(err)(f"orchestrator {address}: {err}")
    named.code = err.code
    named.address = address
    return named


def connection_lost(exc: grpc.RpcError) -> bool:
    """True when the call failed because the server or the connection to it went away."""
    code = exc.code() if hasattr(exc, "code") else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = exc.details() if hasattr(exc, "details") else ""
    return code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and bool(_DROPPED.search(details or ""))


class Endpoints:
    """Orchestrator addresses: round-robin over new calls, the next one after a failure."""

    def __init__(self, addresses: str | Sequence[str]) -> None:
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",")]
        self.addresses = [a for a in addresses if a]
        if not self.addresses:
            raise ValueError("give at least one orchestrator address, e.g. 127.0.0.1:50051")
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def first(self) -> int:
        with self._lock:
            return next(self._counter) % len(self.addresses)

    def next(self, index: int) -> int:
        return (index + 1) % len(self.addresses)

    def order(self) -> list[str]:
        """Every address once, starting at the next one in the rotation."""
        start = self.first()
        return self.addresses[start:] + self.addresses[:start]


class Deadline:
    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


class StreamRun:
    """The bookkeeping of one streamed generation across attempts (no I/O here).

    It counts the tokens delivered to the caller, remembers the session id, and after a failure
    decides whether to give up (and with which typed error) or to try again: with the original
    request while nothing was delivered, with `resume_from` once the session is known.
    """

    def __init__(self, request: pb.GenerateRequest, endpoints: Endpoints, *, resume: bool,
                 deadline: Deadline, max_attempts: int, initial_backoff_s: float, max_backoff_s: float,
                 token: str | None = None) -> None:
        self.request = request
        self.token = token
        self.endpoints = endpoints
        self.resume = resume
        self.deadline = deadline
        self.max_attempts = max_attempts
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.index = endpoints.first()
        self.attempt = 0
        self.session_id = ""
        self.received = 0  # tokens of this generation delivered to the caller
        self.resumes = 0
        self.resuming = False  # the current attempt is a resume request
        self._expect_offset: int | None = None

    @property
    def address(self) -> str:
        return self.endpoints.addresses[self.index]

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self.token)

    def next_request(self) -> pb.GenerateRequest:
        if not self.resuming:
            return self.request
        return pb.GenerateRequest(session_id=self.session_id, resume_from=self.received)

    def accept(self, msg: pb.GenerateChunk) -> Chunk | None:
        """The chunk to hand to the caller, or None for a content-free header."""
        if msg.session_id:
            self.session_id = msg.session_id
        if is_header(msg):
            return None
        if self._expect_offset is not None and msg.token_ids:
            if msg.offset != self._expect_offset:
                raise Internal(f"orchestrator {self.address} resumed session {self.session_id} at token "
                               f"{msg.offset}, but the client holds {self._expect_offset}")
            self._expect_offset = None
        self.received += len(msg.token_ids)
        return chunk_from_pb(msg)

    def failed(self, exc: grpc.RpcError) -> tuple[SpecdecError | None, float]:
        """After a failed attempt: (error to raise, None) or (None, seconds to wait before the next)."""
        error = typed_error(exc, self.address)
        if not connection_lost(exc):
            return error, 0.0
        if self.session_id and not self.resume:
            return error, 0.0  # the server took the request, and the caller does not want a resume
        self.attempt += 1
        backoff = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (self.attempt - 1))
        remaining = self.deadline.remaining()
        if self.attempt >= self.max_attempts or (remaining is not None and remaining <= backoff):
            return error, 0.0
        # No chunk arrived (so no session is known and nothing was delivered): send the original
        # request again. Otherwise resume the generation after the tokens the caller already has.
        self.resuming = bool(self.session_id)
        if self.resuming:
            self.resumes += 1
            self._expect_offset = self.received
        self.index = self.endpoints.next(self.index)
        # A fresh address is tried at once; the same one again only after a pause.
        untried = self.attempt < len(self.endpoints.addresses)
        return None, 0.0 if untried else backoff


class _Base:
    """Settings and the address book both clients hold."""

    def __init__(self, addresses: str | Sequence[str] = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, resume: bool = True,
                 max_attempts: int = 5, initial_backoff_s: float = 0.1, max_backoff_s: float = 2.0,
                 options: Sequence[tuple[str, Any]] = (), token: str | None = None,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> None:
        """
        addresses: one "host:port", a comma-separated list, or a sequence of them.
        timeout: default deadline of every call, seconds (None: no deadline); each call may set its own.
        credentials: `grpc.ssl_channel_credentials(...)` for TLS (None: plaintext).
        resume: resume broken streams from where they stopped (each call may set its own).
        max_attempts: attempts of one stream in all (first try, retries and resumes).
        initial_backoff_s, max_backoff_s: pause before trying an address again, doubling per attempt.
        options: extra gRPC channel options.
        token: bearer token sent with every call (each call may pass its own `token=`).
        tls_ca, tls_cert, tls_key: PEM paths or bytes; any of them turns TLS on (`tls_ca` verifies the
            orchestrator, None: the system's roots; `tls_cert` + `tls_key`: a client certificate).
        """
        self.endpoints = Endpoints(addresses)
        self.timeout = timeout
        if credentials is None and (tls_ca is not None or tls_cert is not None):
            credentials = tls_credentials(tls_ca, tls_cert, tls_key)
        self.credentials = credentials
        self.token = token
        self.resume = resume
        self.max_attempts = max(1, max_attempts)
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.options = channel_options(options)
        self._stubs: dict[str, orchestrator_pb2_grpc.OrchestratorStub] = {}
        self._channels: list[Any] = []

    @property
    def addresses(self) -> list[str]:
        return list(self.endpoints.addresses)

    @property
    def address(self) -> str:
        return self.endpoints.addresses[0]

    def _stub(self, address: str) -> orchestrator_pb2_grpc.OrchestratorStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = self._make_channel(address)
            self._channels.append(ch)
            stub = self._stubs[address] = orchestrator_pb2_grpc.OrchestratorStub(ch)
        return stub

    def _make_channel(self, address: str):
        raise NotImplementedError

    def _run(self, request: pb.GenerateRequest, timeout: Any, resume: bool | None, token: Any = None) -> StreamRun:
        return StreamRun(request, self.endpoints, resume=self.resume if resume is None else resume,
                         deadline=Deadline(self.timeout if timeout is _DEFAULT else timeout),
                         max_attempts=self.max_attempts, initial_backoff_s=self.initial_backoff_s,
                         max_backoff_s=self.max_backoff_s, token=self._token(token))

    def _token(self, token: Any) -> str | None:
        return self.token if token is None else token

    def _timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is _DEFAULT else timeout


_DEFAULT: Any = object()  # "use the client's default timeout" (None means no deadline)


def _unavailable_everywhere(errors: list[SpecdecError]) -> SpecdecError:
    """One error for a call that found every address UNAVAILABLE."""
    if len(errors) == 1:
        return errors[0]
    last = errors[-1]
    named = type(last)("no orchestrator answered: " + "; ".join(str(e) for e in errors))
    named.code = last.code
    named.address = getattr(last, "address", "")
    return named


# -- blocking client ----------------------------------------------------------------------------


class Stream:
    """An iterator of `Chunk`s; `session_id`, `received` and `resumes` tell where it stands."""

    def __init__(self, run: StreamRun, chunks: Iterator[Chunk]) -> None:
        self._run = run
        self._chunks = chunks

    @property
    def session_id(self) -> str:
        return self._run.session_id

    @property
    def received(self) -> int:
        return self._run.received

    @property
    def resumes(self) -> int:
        return self._run.resumes

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop early: cancels the call (the server frees the session's in-flight work)."""
        self._chunks.close()


class Client(_Base):
    """Blocking client. Errors are raised as `specdec.errors` types."""

    def _make_channel(self, address: str) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(address, self.credentials, options=self.options)
        return grpc.insecure_channel(address, options=self.options)

    def stream(self, prompt: str | None = None, *, timeout: float | None = _DEFAULT, resume: bool | None = None,
               token: str | None = None, **kwargs) -> Stream:
        """Generate, yielding a `Chunk` per speculative round; keyword arguments as in `build_request`."""
        run = self._run(build_request(prompt, **kwargs), timeout, resume, token)
        return Stream(run, self._chunks(run))

    def _chunks(self, run: StreamRun) -> Iterator[Chunk]:
        while True:
            call = self._stub(run.address).Generate(run.next_request(), timeout=run.deadline.remaining(),
                                                    metadata=run.metadata())
            try:
                for msg in call:
                    chunk = run.accept(msg)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as exc:
                error, wait = run.failed(exc)
                if error is not None:
                    raise error from None
            finally:
                call.cancel()
            time.sleep(wait)

    def generate(self, prompt: str | None = None, *, timeout: float | None = _DEFAULT, resume: bool | None = None,
                 **kwargs) -> Generation:
        """Generate and return the whole result (streamed underneath, so it resumes the same way)."""
        stream = self.stream(prompt, timeout=timeout, resume=resume, **kwargs)
        collector = Collector()
        for chunk in stream:
            collector.add(chunk)
        return collector.result(stream.resumes)

    def chat(self, messages: Sequence[dict[str, str]], **kwargs) -> Generation:
        """`generate` with chat messages ([{"role": "user", "content": "..."}, ...])."""
        return self.generate(messages=messages, **kwargs)

    def _unary(self, method: str, request, timeout: Any, token: str | None = None):
        errors: list[SpecdecError] = []
        for address in self.endpoints.order():
            try:
                return address, getattr(self._stub(address), method)(
                    request, timeout=self._timeout(timeout), metadata=call_metadata(self._token(token)))
            except grpc.RpcError as exc:
                errors.append(typed_error(exc, address))
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    break
        raise _unavailable_everywhere(errors)

    def close_session(self, session_id: str, *, timeout: float | None = _DEFAULT, token: str | None = None) -> bool:
        """Delete a session and free its caches; False if it did not exist."""
        _, reply = self._unary("CloseSession", pb.CloseSessionRequest(session_id=session_id), timeout, token)
        return reply.closed

    def status(self, *, timeout: float | None = _DEFAULT, token: str | None = None) -> dict[str, Any]:
        """Health, models, load and acceptance of an orchestrator and its backends (GetStatus)."""
        address, reply = self._unary("GetStatus", pb.GetStatusRequest(), timeout, token)
        return status_from_pb(reply, address)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        self._stubs.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- asyncio client -----------------------------------------------------------------------------


class AsyncStream:
    """An async iterator of `Chunk`s; `session_id`, `received` and `resumes` tell where it stands."""

    def __init__(self, run: StreamRun, chunks: AsyncIterator[Chunk]) -> None:
        self._run = run
        self._chunks = chunks

    session_id = Stream.session_id
    received = Stream.received
    resumes = Stream.resumes

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """Stop early: cancels the call."""
        await self._chunks.aclose()


class AsyncClient(_Base):
    """asyncio client with the same methods as `Client`, as coroutines and async iterators."""

    def _make_channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is not None:
            return grpc.aio.secure_channel(address, self.credentials, options=self.options)
        return grpc.aio.insecure_channel(address, options=self.options)

    def stream(self, prompt: str | None = None, *, timeout: float | None = _DEFAULT, resume: bool | None = None,
               token: str | None = None, **kwargs) -> AsyncStream:
        """Generate, yielding a `Chunk` per speculative round: `async for chunk in client.stream(...)`."""
        run = self._run(build_request(prompt, **kwargs), timeout, resume, token)
        return AsyncStream(run, self._chunks(run))

    async def _chunks(self, run: StreamRun) -> AsyncIterator[Chunk]:
        while True:
            call = self._stub(run.address).Generate(run.next_request(), timeout=run.deadline.remaining(),
                                                    metadata=run.metadata())
            try:
                async for msg in call:
                    chunk = run.accept(msg)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as exc:
                error, wait = run.failed(exc)
                if error is not None:
                    raise error from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = _DEFAULT,
                       resume: bool | None = None, **kwargs) -> Generation:
        """Generate and return the whole result (streamed underneath, so it resumes the same way)."""
        stream = self.stream(prompt, timeout=timeout, resume=resume, **kwargs)
        collector = Collector()
        async for chunk in stream:
            collector.add(chunk)
        return collector.result(stream.resumes)

    async def chat(self, messages: Sequence[dict[str, str]], **kwargs) -> Generation:
        return await self.generate(messages=messages, **kwargs)

    async def _unary(self, method: str, request, timeout: Any, token: str | None = None):
        errors: list[SpecdecError] = []
        for address in self.endpoints.order():
            try:
                return address, await getattr(self._stub(address), method)(
                    request, timeout=self._timeout(timeout), metadata=call_metadata(self._token(token)))
            except grpc.RpcError as exc:
                errors.append(typed_error(exc, address))
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    break
        raise _unavailable_everywhere(errors)

    async def close_session(self, session_id: str, *, timeout: float | None = _DEFAULT,
                            token: str | None = None) -> bool:
        _, reply = await self._unary("CloseSession", pb.CloseSessionRequest(session_id=session_id), timeout, token)
        return reply.closed

    async def status(self, *, timeout: float | None = _DEFAULT, token: str | None = None) -> dict[str, Any]:
        address, reply = await self._unary("GetStatus", pb.GetStatusRequest(), timeout, token)
        return status_from_pb(reply, address)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
        self._channels.clear()
        self._stubs.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
