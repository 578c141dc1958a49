"""The two APIs a load test drives: gRPC (the SDK's AsyncClient) and OpenAI-compatible HTTP.

Each client sends one request and fills a `RequestRecord`: when each chunk arrived and how many
tokens it held, TTFT, end-to-end latency, the server's totals and, over gRPC, every round's
statistics; `send` returns the answer's text (a multi-turn session sends it back in the next
turn's history; None when the request failed). Errors never escape `send`: they become the
record's status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from loadtest.metrics import RequestRecord, Round
from loadtest.workloads import WorkItem


class ServerNotFound(RuntimeError):
    """Nothing answers at the address: the message says which address and what to run."""


START_HINT = ("Start the pipeline with `specdec up` (or `specdec up --detach`), or let the load test start "
              "one itself: `specdec loadtest --start-pipeline ...`.")


def draft_length_value(mode: str) -> int | str:
    """A mode as the API takes it: "auto" or an int k (0 = plain decoding)."""
    if mode == "auto":
        return "auto"
    k = int(mode)
    if k < 0:
        raise ValueError(f"a draft length is auto or k >= 0, got {mode!r}")
    return k


class GrpcLoadClient:
    """Requests through `specdec.AsyncClient` (one channel, multiplexed)."""

    api = "grpc"

    def __init__(self, address: str, timeout_s: float = 300.0) -> None:
        from specdec.client import AsyncClient

        self.address = address
        self.client = AsyncClient(address, timeout=timeout_s)

    async def check(self) -> dict[str, Any]:
        """The orchestrator's GetStatus, or ServerNotFound."""
        from specdec.errors import SpecdecError

        try:
            return await self.client.status(timeout=10)
        except SpecdecError as exc:
            raise ServerNotFound(f"no specdec orchestrator answers gRPC at {self.address} ({exc}). "
                                 f"{START_HINT}") from None

    async def send(self, item: WorkItem, mode: str, params: dict[str, Any], rec: RequestRecord,
                   clock: Callable[[], float]) -> str | None:
        from specdec.errors import SpecdecError

        sent = time.perf_counter()
        text: list[str] = []
        try:
            stream = self.client.stream(messages=item.messages(), draft_length=draft_length_value(mode), **params)
            async for chunk in stream:
                now = time.perf_counter()
                text.append(chunk.text)
                n = len(chunk.token_ids)
                if n:
                    if rec.ttft is None:
                        rec.ttft = now - sent
                    r = chunk.round
                    rec.round_stats.append(Round(at=clock(), k=int(r.get("draft_length", 0)),
                                                 proposed=int(r.get("proposed", 0)),
                                                 accepted=int(r.get("accepted", 0)),
                                                 fallback=bool(r.get("draft_fallback", False))))
                rec.chunks.append((now - sent, n))
                if chunk.stats:
                    _totals(rec, chunk.stats)
            rec.e2el = time.perf_counter() - sent
            rec.output_tokens = rec.output_tokens or sum(n for _, n in rec.chunks)
            rec.resumes = stream.resumes
            rec.ok = True
            return "".join(text)
        except SpecdecError as exc:
            rec.status, rec.error = exc.code, str(exc)
        except Exception as exc:  # noqa: BLE001 - a load test counts every failure and goes on
            rec.status, rec.error = type(exc).__name__, str(exc)
        return None

    async def close(self) -> None:
        await self.client.close()


class HttpLoadClient:
    """Streamed chat completions through the `openai` package's AsyncOpenAI."""

    api = "http"

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        try:
            import openai
        except ImportError:  # pragma: no cover - a dev dependency
            raise RuntimeError("the HTTP load test needs the openai package: pip install -e '.[dev]'") from None
        self.openai = openai
        self.base_url = base_url.rstrip("/")
        self.client = openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=timeout_s)
        self.model = ""

    async def check(self) -> dict[str, Any]:
        """The served model (needed by every request), or ServerNotFound."""
        try:
            models = await self.client.models.list(timeout=10)
        except self.openai.APIError as exc:
            raise ServerNotFound(f"no OpenAI-compatible specdec API answers at {self.base_url} "
                                 f"({type(exc).__name__}: {exc}). {START_HINT} (`specdec up` serves HTTP on "
                                 "port 8000; the load test adds it with --api http)") from None
        if not models.data:
            raise ServerNotFound(f"{self.base_url}/models lists no model")
        self.model = models.data[0].id
        return {"address": self.base_url, "model": self.model}

    async def send(self, item: WorkItem, mode: str, params: dict[str, Any], rec: RequestRecord,
                   clock: Callable[[], float]) -> str | None:
        openai = self.openai
        body = {"draft_length": draft_length_value(mode)}
        for name in ("top_k", "share_output"):  # specdec's extensions
            if params.get(name) is not None:
                body[name] = params[name]
        names = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed"}
        sampling = {names[k]: v for k, v in params.items() if k in names and v is not None}  # unset: the server's
        sent = time.perf_counter()
        answer: list[str] = []
        try:
            stream = await self.client.chat.completions.create(
                model=self.model, messages=item.messages(), stream=True, stream_options={"include_usage": True},
                extra_body=body, **sampling)
            async for event in stream:
                now = time.perf_counter()
                text = event.choices[0].delta.content if event.choices else None
                if text:
                    answer.append(text)
                    if rec.ttft is None:
                        rec.ttft = now - sent
                    rec.chunks.append((now - sent, None))  # tokens per event: not on the wire
                if event.usage is not None:
                    usage = event.usage
                    spec = dict(getattr(usage, "speculation", None) or {})
                    _totals(rec, {"completion_tokens": usage.completion_tokens,
                                  "prompt_tokens": usage.prompt_tokens, **spec})
            rec.e2el = time.perf_counter() - sent
            rec.ok = True
            return "".join(answer)
        except openai.APIStatusError as exc:
            rec.status, rec.error = f"HTTP {exc.status_code}", str(exc)
        except openai.APITimeoutError as exc:
            rec.status, rec.error = "timeout", str(exc)
        except openai.APIConnectionError as exc:
            rec.status, rec.error = "connection_error", str(exc)
        except openai.APIError as exc:  # an error event in the middle of a stream
            rec.status, rec.error = f"stream_error:{getattr(exc, 'code', None) or 'unknown'}", str(exc)
        except Exception as exc:  # noqa: BLE001
            rec.status, rec.error = type(exc).__name__, str(exc)
        return None

    async def close(self) -> None:
        await self.client.close()


def _totals(rec: RequestRecord, stats: dict[str, Any]) -> None:
    """The generation's totals as the server reports them (GenerationStats or usage.speculation)."""
    rec.output_tokens = int(stats.get("completion_tokens", 0) or 0)
    rec.prompt_tokens = int(stats.get("prompt_tokens", 0) or 0)
    rec.draft_tokens = int(stats.get("draft_tokens", 0) or 0)
    rec.accepted_tokens = int(stats.get("accepted_tokens", 0) or 0)
    rec.rounds = int(stats.get("rounds", 0) or 0)
    rec.fallbacks = int(stats.get("draft_fallbacks", 0) or 0)
