"""ProposeBatch against a real draft service process (suffix speculation on the default model's tokenizer):
one call per engine step, a block per request, histories kept by the service, finished outputs joining
their corpus group, and hostile batches refused with INVALID_ARGUMENT naming the field; and a model
draft's blocks saying how much history they prefilled."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from specdec.launcher import free_port, wait_healthy
from specdec.v1 import draft_pb2, draft_pb2_grpc

ROW = [101, 202, 303, 404, 505, 606, 707]


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("draft") / "draft.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--host", "127.0.0.1", "--port", str(port),
                                 "--proposer", "suffix", "--suffix-spec-factor", "0"],  # (whole continuations)
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"127.0.0.1:{port}", 120, proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield draft_pb2_grpc.DraftServiceStub(channel)
    finally:
        proc.terminate()
        proc.wait(10)


def _call(stub, entries=(), finished=()):
    return stub.ProposeBatch(draft_pb2.ProposeBatchRequest(entries=list(entries), finished=list(finished)),
                             timeout=10)


def test_one_call_drafts_every_request_and_keeps_their_histories(stub):
    repeated = draft_pb2.BatchEntry(session_id="a", tokens=ROW + [1, 2] + ROW[:3], num_tokens=4, output_start=7)
    plain = draft_pb2.BatchEntry(session_id="b", tokens=[9, 8, 7], num_tokens=4, output_start=3)
    reply = _call(stub, [repeated, plain])
    assert [list(b.token_ids) for b in reply.blocks] == [ROW[3:7], []]
    assert reply.blocks[0].source == draft_pb2.DRAFT_SOURCE_SUFFIX and not reply.blocks[0].history_missing
    # Next step: only the new tokens (from position 12); the service extends the history it holds.
    step = draft_pb2.BatchEntry(session_id="a", start=12, tokens=ROW[3:5], num_tokens=2, output_start=7)
    assert list(_call(stub, [step]).blocks[0].token_ids) == ROW[5:7]


def test_a_session_the_replica_does_not_hold_asks_for_its_history(stub):
    reply = _call(stub, [draft_pb2.BatchEntry(session_id="unknown", start=50, tokens=[1], num_tokens=3)])
    assert reply.blocks[0].history_missing and not reply.blocks[0].token_ids


def test_a_finished_output_drafts_its_group_only(stub):
    first = draft_pb2.BatchEntry(session_id="g1", tokens=[5, 5, 5], num_tokens=0, output_start=3, corpus_group="t1")
    _call(stub, [first])
    done = draft_pb2.FinishedSession(session_id="g1", start=3, tokens=[11, 12, 13, 14, 15, 16, 17, 18])
    assert _call(stub, finished=[done]).outputs_learned == 1
    same = draft_pb2.BatchEntry(session_id="g2", tokens=[3, 11, 12, 13], num_tokens=3, corpus_group="t1")
    other = draft_pb2.BatchEntry(session_id="g3", tokens=[3, 11, 12, 13], num_tokens=3, corpus_group="t2")
    reply = _call(stub, [same, other])
    assert [list(b.token_ids) for b in reply.blocks] == [[14, 15, 16], []]
    forgotten = draft_pb2.FinishedSession(session_id="g2", forget_output=True)
    assert _call(stub, finished=[forgotten]).outputs_learned == 0
    # A session this replica never held (another one drafted it, then died): the whole history comes along.
    whole = draft_pb2.FinishedSession(session_id="g4", tokens=[7, 21, 22, 23, 24], output_start=1, corpus_group="t2")
    assert _call(stub, finished=[whole]).outputs_learned == 1
    reply = _call(stub, [draft_pb2.BatchEntry(session_id="g5", tokens=[8, 21, 22], num_tokens=2, corpus_group="t2")])
    assert list(reply.blocks[0].token_ids) == [23, 24]


@pytest.mark.parametrize(("entries", "field"), [
    ([draft_pb2.BatchEntry(session_id="x", tokens=[1], num_tokens=65)], "entries[0].num_tokens"),
    ([draft_pb2.BatchEntry(session_id="x", tokens=[1]), draft_pb2.BatchEntry(session_id="x", tokens=[2])],
     "entries[1].session_id"),
    ([draft_pb2.BatchEntry(session_id="no spaces", tokens=[1])], "entries[0].session_id"),
    ([draft_pb2.BatchEntry(session_id="x", tokens=[1, 10**9], num_tokens=1)], "entries[0].tokens"),
    ([draft_pb2.BatchEntry(session_id="x", tokens=[], num_tokens=1)], "entries[0].tokens"),
    ([draft_pb2.BatchEntry(session_id="x", tokens=[1], output_start=5)], "entries[0].output_start"),
    ([draft_pb2.BatchEntry(session_id="x", tokens=[1], corpus_group="g" * 129)], "entries[0].corpus_group"),
    ([draft_pb2.BatchEntry(session_id=f"s{i}", tokens=[1]) for i in range(1025)], "entries:"),
    ([], "finished[0].output_start"),
])
def test_a_hostile_batch_is_refused_naming_the_field(stub, entries, field):
    finished = [draft_pb2.FinishedSession(session_id="f", tokens=[1], output_start=2)] if not entries else []
    with pytest.raises(grpc.RpcError) as raised:
        _call(stub, entries, finished)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details()


def test_a_tokenizer_mismatch_is_refused(stub):
    request = draft_pb2.ProposeBatchRequest(entries=[draft_pb2.BatchEntry(session_id="x", tokens=[1])],
                                            tokenizer_fingerprint="another")
    with pytest.raises(grpc.RpcError) as raised:
        stub.ProposeBatch(request, timeout=10)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_two_replicas_share_finished_outputs_through_redis(tmp_path):
    """A finished session's output, sent to one replica, drafts a request on another: the first publishes
    it to the shared stream of finished outputs, which every replica reads."""
    from specdec.launcher import redis_server_binary

    redis_port = free_port()
    procs = [subprocess.Popen([redis_server_binary(), "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)]
    ports = [free_port(), free_port()]
    try:
        with open(tmp_path / "drafts.log", "wb") as out:
            for port in ports:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "draft_service", "--host", "127.0.0.1", "--port", str(port), "--proposer",
                     "suffix", "--suffix-redis-url", f"redis://127.0.0.1:{redis_port}/0", "--suffix-spec-factor", "0"],
                    stdout=out, stderr=subprocess.STDOUT))
        for port, proc in zip(ports, procs[1:]):
            wait_healthy(f"127.0.0.1:{port}", 120, proc)
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as one, \
                grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as two:
            first, second = draft_pb2_grpc.DraftServiceStub(one), draft_pb2_grpc.DraftServiceStub(two)
            done = draft_pb2.FinishedSession(session_id="r1", tokens=[4, 31, 32, 33, 34, 35], output_start=1,
                                             corpus_group="team")
            assert _call(first, finished=[done]).outputs_learned == 1
            entry = draft_pb2.BatchEntry(session_id="r2", tokens=[9, 31, 32], num_tokens=3, corpus_group="team")
            deadline, drafted = time.monotonic() + 15, []
            while not drafted and time.monotonic() < deadline:
                drafted = list(_call(second, [entry]).blocks[0].token_ids)
                time.sleep(0.2)
            assert drafted == [33, 34, 35]
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)


def test_a_model_draft_warms_a_long_prompt_in_the_background_and_says_what_it_prefilled(tiny_models, tmp_path):
    """A long prompt's first call is answered at once, `warming`, while the draft model prefills it
    (the engine's step does not wait for it); later calls get blocks that prefilled only the tokens
    past the cache, so the caller's draft-length policy does not take a prompt's prefill for the
    cost of drafting. A short history is drafted at once, its prefill reported."""
    port = free_port()
    with open(tmp_path / "draft.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--host", "127.0.0.1", "--port", str(port),
                                 "--proposer", "model", "--model", str(tiny_models["good_draft"]), "--dtype", "float64",
                                 "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"127.0.0.1:{port}", 120, proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            short = [5, 9, 13, 17, 21, 25]
            block = _call(stub, [draft_pb2.BatchEntry(session_id="s", tokens=short, num_tokens=3)]).blocks[0]
            assert not block.warming and len(block.token_ids) == 3 and block.prefill_tokens >= len(short) - 1, block

            history = [5 + (i * 7) % 90 for i in range(400)]
            first = _call(stub, [draft_pb2.BatchEntry(session_id="m", tokens=history, num_tokens=3)]).blocks[0]
            assert first.warming and not first.token_ids and not first.history_missing, first
            blocks, deadline = [], time.monotonic() + 60
            while not blocks or blocks[-1].warming:  # the engine's steps go on meanwhile, a token each
                assert time.monotonic() < deadline, "the prompt was never prefilled"
                history.append(7)
                blocks.append(_call(stub, [draft_pb2.BatchEntry(session_id="m", start=len(history) - 1,
                                                                tokens=history[-1:], num_tokens=3)]).blocks[0])
            assert len(blocks[-1].token_ids) == 3 and 1 <= blocks[-1].prefill_tokens <= len(blocks), blocks[-1]
            accepted = list(blocks[-1].token_ids) + [7]  # the whole block, and a bonus token
            steady = _call(stub, [draft_pb2.BatchEntry(session_id="m", start=len(history), tokens=accepted,
                                                       num_tokens=3)]).blocks[0]
            assert len(steady.token_ids) == 3 and 1 <= steady.prefill_tokens <= 2, steady
    finally:
        proc.terminate()
        proc.wait(10)
