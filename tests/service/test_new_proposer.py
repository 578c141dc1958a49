"""A new draft source is one class and a registry entry, and nothing else.

`Oracle`, defined here and registered here, runs through the draft service's own gRPC API in this
process (Propose, GetInfo, Release) and then through an orchestrator's loop against that service:
its blocks stream with their sources, GetInfo reports its sources, the orchestrator picks the
per-source draft-length controller from them, and closing the session releases it on the draft.
No edit to the Drafter, the draft servicer, the orchestrator loop or the controller factory.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest

from draft_service.config import PROPOSER_OPTIONS, DraftConfig, ProposerOptions
from draft_service.registry import PROPOSERS
from draft_service.server import SERVICE_NAME, build_servicer
from orchestrator.backends import DraftBackend
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Orchestrator
from orchestrator.replicas import DraftPool
from specdec.channel import channel
from specdec.runtime.drafting import Block, DraftEnv, DraftRequest, DraftToken
from specdec.server.serving import create_server
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2 as pb
from tests.unit.fakes import CharTokenizer, FakeTarget, InMemorySessionStore, tokens

PROMPT = "Once upon a time"
REFERENCE = tokens(PROMPT + " an oracle drafted every token the target was about to write.")
START = len(tokens(PROMPT))


class Oracle:
    """Proposes what the target will write next (the test knows it), naming its blocks "ngram" and
    "suffix" in turn. A `Proposer` from scratch: no base class."""

    sources = ("ngram", "suffix")
    learns_outputs = False

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference
        self.sessions: set[str] = set()  # what it holds per session: that it saw it
        self.calls = 0

    def propose(self, session_id: str, history: list[int], k: int, params, seed: int) -> list[DraftToken]:
        self.sessions.add(session_id)
        if history != self.reference[:len(history)]:
            return []
        source, self.calls = self.sources[self.calls % 2], self.calls + 1
        return [DraftToken(t, None, 1000, source=source) for t in self.reference[len(history):len(history) + k]]

    async def block(self, request: DraftRequest, env: DraftEnv) -> Block:
        drafts = await env.proposal(self.propose, request)  # on the worker thread, cut by any grammar
        return Block.listed(drafts[0].source if drafts else "ngram", drafts, request.arrived)

    async def release(self, session_id: str, learn: bool = True, sent_unix_ns: int = 0) -> bool:
        held = session_id in self.sessions
        self.sessions.discard(session_id)
        return held

    def add_output(self, tokens: list[int]) -> None:
        pass


class OracleConfig(DraftConfig):
    proposer: str = "oracle"  # a real proposer adds its name to DraftConfig.proposer's choices instead


@pytest.fixture
def oracle(monkeypatch) -> Oracle:
    made = Oracle(REFERENCE)
    monkeypatch.setitem(PROPOSER_OPTIONS, "oracle", ProposerOptions("a test's oracle"))
    monkeypatch.setitem(PROPOSERS, "oracle", lambda config, host: made)
    return made


@asynccontextmanager
async def draft_service(tiny_models):
    """The draft service of `--proposer oracle` on a free port in this process; yields its address and stub."""
    servicer, _ = build_servicer(OracleConfig(model=str(tiny_models["target"])))
    server, port, _ = create_server(
        "127.0.0.1:0", [lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s)], [SERVICE_NAME])
    await server.start()
    ch = channel(f"127.0.0.1:{port}")
    try:
        yield f"127.0.0.1:{port}", draft_pb2_grpc.DraftServiceStub(ch)
    finally:
        await ch.close()
        await server.stop(None)


async def test_a_registered_proposer_serves_propose_getinfo_and_release(tiny_models, oracle):
    async with draft_service(tiny_models) as (_, stub):
        info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert info.kind == "oracle" and list(info.draft_sources) == ["ngram", "suffix"]
        assert not info.learns_outputs and info.max_batch == 0  # no model: nothing batched
        history = REFERENCE[:START]
        request = draft_pb2.ProposeRequest(session_id="s", history=history, num_tokens=4)
        got = [p async for p in stub.Propose(request, timeout=10)]
        assert [p.token_id for p in got] == REFERENCE[START:START + 4]
        assert {p.source for p in got} == {draft_pb2.DRAFT_SOURCE_NGRAM} and not any(p.probs for p in got)
        release = common_pb2.ReleaseRequest(session_id="s")
        assert (await stub.Release(release, timeout=10)).released
        assert not (await stub.Release(release, timeout=10)).released and not oracle.sessions


async def test_an_orchestrator_runs_it_with_a_controller_state_per_source(tiny_models, oracle):
    async with draft_service(tiny_models) as (address, stub):
        fingerprint = (await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)).tokenizer_fingerprint
        draft = DraftPool(address, lambda a: DraftBackend(a, 10.0), retry_s=1.0)
        await draft.start(timeout_s=10)
        draft.expected_fingerprint = fingerprint
        await draft.refresh()
        store, target = InMemorySessionStore(), FakeTarget(REFERENCE)
        info = common_pb2.ModelInfo(tokenizer_fingerprint=fingerprint, max_context=4096, eos_token_ids=[2])
        orch = Orchestrator(OrchestratorConfig(target="fake:1", draft_length="auto"), store, target, draft,
                            CharTokenizer(), info)
        for draft_length in (-1, 2):  # auto (the controller), then a fixed k that drafts every round
            request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24, draft_length=draft_length)
            chunks = [chunk async for chunk in orch.generate(orch.parse(request))]
            assert [t for c in chunks for t in c.token_ids] == REFERENCE[START:START + 24]
            stats = chunks[-1].stats
            assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens  # an oracle is always right
            if draft_length == -1:
                session = chunks[0].session_id
                policy = (await store.load(session)).policy
                assert set(policy["by_source"]) == {"suffix"}  # one state per source; "ngram" is the primary
        by_source = {source: orch.metrics.registry.get_sample_value(
            "specdec_spec_decode_num_draft_tokens_by_source_total", {"service": "orchestrator", "source": source})
            for source in ("ngram", "suffix")}
        assert all(by_source.values()), by_source
        assert session in oracle.sessions
        await orch.close_session(session)
        assert session not in oracle.sessions  # the orchestrator's release reached the proposer
        await draft.close()
