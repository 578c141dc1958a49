"""The SDK against real processes: both clients, sessions, deadlines, GetStatus, and resume after a crash.

The crash tests start more orchestrator replicas on the shared pipeline's Redis, target and draft,
kill the one a stream is on (SIGKILL, mid-generation), and check that the client finishes the
generation on another with every token exactly once (or, with resume=False, raises UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from specdec import AsyncClient, Client, errors
from specdec.launcher import free_port, wait_healthy
from tests.conftest import orchestrator_address

PROMPTS = ["Once upon a time", "def main():\n", "Roses are red,", "The answer is", "SELECT * FROM",
           "It was a dark and stormy night", "abcabcabc"]


@pytest.fixture(scope="module")
def long_prompt(reference) -> tuple[str, list[int]]:
    """A prompt whose greedy continuation runs 80 tokens without an end-of-sequence token."""
    for prompt in PROMPTS:
        tokens = reference.greedy(prompt, 80)
        if len(tokens) == 80 and tokens[-1] not in reference.loaded.eos_token_ids:
            return prompt, tokens
    pytest.fail("no bundled prompt runs 80 greedy tokens without EOS on the tiny model")


def test_sync_and_async_clients_agree_with_the_target(tiny_pipeline, long_prompt):
    prompt, expected = long_prompt
    address = orchestrator_address(tiny_pipeline)
    with Client(address) as client:
        out = client.generate(prompt, max_new_tokens=40, temperature=0)
        streamed = list(client.stream(prompt, max_new_tokens=40, temperature=0))

    async def run_async():
        async with AsyncClient(address) as client:
            whole = await client.generate(prompt, max_new_tokens=40, temperature=0)
            chunks = [c async for c in client.stream(prompt, max_new_tokens=40, temperature=0)]
            return whole, chunks

    async_out, async_chunks = asyncio.run(run_async())
    assert out.token_ids == async_out.token_ids == expected[:40]
    assert out.text == async_out.text == "".join(c.text for c in streamed) == "".join(c.text for c in async_chunks)
    assert out.finish_reason == "length" and out.stats["completion_tokens"] == 40
    assert [t for c in streamed for t in c.token_ids] == expected[:40]
    assert all(c.token_ids for c in streamed)  # no empty header chunk reaches the caller
    assert all(isinstance(c.round["draft_ns"], int) for c in streamed)  # 64-bit stats stay numbers


def test_session_continue_and_close(tiny_pipeline):
    with Client(orchestrator_address(tiny_pipeline)) as client:
        first = client.chat([{"role": "user", "content": "Hello"}], max_new_tokens=6, temperature=0)
        second = client.chat([{"role": "user", "content": "And then?"}], session_id=first.session_id,
                             max_new_tokens=6, temperature=0)
        assert second.session_id == first.session_id
        # the second turn's prompt is the whole history: first prompt, first reply, new turn
        assert second.stats["prompt_tokens"] > first.stats["prompt_tokens"] + first.stats["completion_tokens"]
        assert client.close_session(first.session_id) is True
        with pytest.raises(errors.NotFound, match="does not exist"):
            client.generate("more", session_id=first.session_id)
        assert client.close_session(first.session_id) is False


def test_deadline(tiny_pipeline, long_prompt):
    """A generation that takes several times the deadline (as many tokens as the tiny model's
    context holds, one a round; timed first, and the deadline a quarter of that time, so it falls
    inside the generation on a fast machine as on a slow one) ends with DeadlineExceeded, whether
    the deadline is the call's or the client's."""
    prompt, _ = long_prompt
    request = dict(max_new_tokens=400, temperature=0, draft_length=0, ignore_eos=True)
    with Client(orchestrator_address(tiny_pipeline)) as client:
        start = time.monotonic()
        assert len(client.generate(prompt, **request).token_ids) == 400
        deadline = (time.monotonic() - start) / 4
        assert deadline > 0.02, "the generation is too fast to test a deadline with"
        with pytest.raises(errors.DeadlineExceeded):
            client.generate(prompt, **request, timeout=deadline)
        client_default = Client(orchestrator_address(tiny_pipeline), timeout=deadline)
        with client_default, pytest.raises(errors.DeadlineExceeded):
            list(client_default.stream(prompt, **request))


def _quiet_status(client: Client, within_s: float = 30.0) -> dict:
    """GetStatus once no generation is running: one that an earlier test's client gave up on
    (a passed deadline) ends on the server a round later, and would be counted in between."""
    deadline = time.monotonic() + within_s
    status = client.status()
    while status["active_generations"] and time.monotonic() < deadline:
        time.sleep(0.05)
        status = client.status()
    assert status["active_generations"] == 0, "a generation of an earlier test is still running"
    return status


def test_status_counts_what_it_served(tiny_pipeline):
    with Client(orchestrator_address(tiny_pipeline)) as client:
        before = _quiet_status(client)
        out = client.generate("Hello", max_new_tokens=12, temperature=0, draft_length=3)
        after = client.status()
    assert after["version"] and after["uptime_s"] >= before["uptime_s"]
    assert after["default_draft_length"] == "4" and after["active_generations"] == 0
    assert after["generations_total"] - before["generations_total"] == 1
    assert after["generated_tokens"] - before["generated_tokens"] == out.stats["completion_tokens"]
    assert after["draft_tokens"] - before["draft_tokens"] == out.stats["draft_tokens"] > 0
    assert after["accepted_tokens"] - before["accepted_tokens"] == out.stats["accepted_tokens"]
    backends = {b["role"]: b for b in after["backends"]}
    assert set(backends) == {"target", "draft"}
    assert all(b["healthy"] and b["error"] == "" and b["rtt_ms"] > 0 for b in backends.values())
    assert backends["target"]["kind"] == "model" and backends["target"]["dtype"] == "float64"
    assert backends["target"]["address"] == tiny_pipeline.plan.grpc_addresses()["target"]


@pytest.fixture(scope="module")
def replicas(tiny_pipeline, tmp_path_factory):
    """Three more orchestrator replicas sharing the pipeline's Redis, target and draft; the third also
    lists a draft replica that does not exist."""
    base = tiny_pipeline.plan.commands()["orchestrator"]
    logs = tmp_path_factory.mktemp("replicas")
    procs, addresses = [], []
    try:
        for i in range(3):
            port = free_port()
            cmd = list(base)
            cmd[cmd.index("--port") + 1] = str(port)
            if i == 2:
                cmd[cmd.index("--draft") + 1] += f",127.0.0.1:{free_port()}"
            with open(logs / f"orchestrator-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            addresses.append(f"127.0.0.1:{port}")
        for proc, address in zip(procs, addresses):
            wait_healthy(address, 120, proc)
        yield procs, addresses
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


def test_status_reports_a_dead_backend(replicas, tiny_pipeline):
    _, addresses = replicas
    with Client(addresses[2]) as client:
        status = client.status()
    drafts = {b["address"]: b for b in status["backends"] if b["role"] == "draft"}
    live = tiny_pipeline.plan.grpc_addresses()["draft"]
    (dead,) = set(drafts) - {live}
    assert drafts[live]["healthy"] and drafts[live]["model"] == "poor_draft"
    assert not drafts[dead]["healthy"] and drafts[dead]["error"] and drafts[dead]["model"] == ""
    assert all(b["healthy"] for b in status["backends"] if b["role"] == "target")


def test_stream_resumes_on_another_orchestrator_after_a_crash(replicas, long_prompt, reference):
    """Needs the server side of resume (resume_from, header chunk, chunk offsets)."""
    procs, addresses = replicas
    prompt, expected = long_prompt
    with Client(addresses[:2]) as client:
        stream = client.stream(prompt, max_new_tokens=80, temperature=0, draft_length=1)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                os.kill(procs[0].pid, signal.SIGKILL)  # the replica this stream is on (round-robin starts there)
    tokens = [t for c in chunks for t in c.token_ids]
    assert stream.resumes == 1
    assert tokens == expected  # nothing lost, nothing twice
    assert "".join(c.text for c in chunks) == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats["completion_tokens"] == 80


def test_no_resume_when_turned_off(replicas, long_prompt):
    procs, addresses = replicas
    prompt, _ = long_prompt
    with Client(addresses[1:], resume=False) as client:
        received = 0
        with pytest.raises(errors.Unavailable, match=addresses[1]):
            for chunk in client.stream(prompt, max_new_tokens=80, temperature=0, draft_length=1):
                received += len(chunk.token_ids)
                if received >= 3 and procs[1].poll() is None:
                    os.kill(procs[1].pid, signal.SIGKILL)
    assert 3 <= received < 80


def test_a_dead_address_is_skipped(tiny_pipeline):
    with Client([f"127.0.0.1:{free_port()}", orchestrator_address(tiny_pipeline)]) as client:
        assert len(client.generate("Hi", max_new_tokens=3, temperature=0).token_ids) >= 1
        assert client.status()["address"] == orchestrator_address(tiny_pipeline)
