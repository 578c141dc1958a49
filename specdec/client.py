"""Python SDK for the orchestrator's public API.

    from specdec import Client
    with Client("127.0.0.1:50051") as client:
        out = client.generate("Once upon a time", max_new_tokens=32)
        print(out.text, out.stats["acceptance_rate"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.errors import from_rpc_error
from specdec.serving import CHANNEL_OPTIONS
from specdec.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

_FINISH = {pb.FINISH_REASON_UNSPECIFIED: None, pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop"}


def _as_dict(msg) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


@dataclass
class Chunk:
    """One streamed round: new tokens, the text they add and the round's statistics."""

    session_id: str
    token_ids: list[int]
    text: str
    round: dict[str, Any]
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # the whole generation's, on the last chunk


@dataclass
class Generation:
    """A finished generation."""

    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict[str, Any] = field(default_factory=dict)


def build_request(prompt: str | None = None, *, messages: Sequence[dict[str, str]] | None = None,
                  max_new_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), draft_length: int | str | None = None,
                  session_id: str = "") -> pb.GenerateRequest:
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt or messages")
    if isinstance(draft_length, str):
        draft_length = -1 if draft_length == "auto" else int(draft_length)  # -1 selects the controller
    req = pb.GenerateRequest(stop=list(stop), session_id=session_id)
    if prompt is not None:
        req.prompt = prompt
    else:
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed), ("draft_length", draft_length)):
        if value is not None:
            setattr(req, name, value)
    return req


class Client:
    """Blocking client of one orchestrator. Errors are raised as `specdec.errors` types."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)

    def generate(self, prompt: str | None = None, **kwargs) -> Generation:
        """Generate and return the whole result; keyword arguments as in `build_request`."""
        timeout = kwargs.pop("timeout", self.timeout)
        try:
            reply = self._stub.GenerateUnary(build_request(prompt, **kwargs), timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return Generation(reply.session_id, reply.text, list(reply.token_ids),
                          _FINISH[reply.finish_reason], _as_dict(reply.stats))

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[Chunk]:
        """Generate, yielding a `Chunk` per speculative round as it is accepted."""
        timeout = kwargs.pop("timeout", self.timeout)
        call = self._stub.Generate(build_request(prompt, **kwargs), timeout=timeout)
        try:
            for msg in call:
                yield Chunk(msg.session_id, list(msg.token_ids), msg.text, _as_dict(msg.round),
                            _FINISH[msg.finish_reason], _as_dict(msg.stats) if msg.HasField("stats") else None)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    def close_session(self, session_id: str) -> bool:
        try:
            return self._stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=self.timeout).closed
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
