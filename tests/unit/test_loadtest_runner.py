"""The load-test loop against a fake client: interleaved phases, the same prompts and seeds in every
mode, concurrency and arrival schedules kept, bounds by count and by duration, failures counted."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.arrivals import arrival_times
from loadtest.runner import Load, LoadTestConfig, run_loadtest


class FakeClient:
    """Answers every request after `delay` seconds with 3 tokens in 2 chunks; fails the prompts asked."""

    api = "fake"

    def __init__(self, delay: float = 0.01, fail_prompts: tuple[str, ...] = ()) -> None:
        self.delay = delay
        self.fail_prompts = fail_prompts
        self.sent: list[tuple[float, str, str, int]] = []  # (time, mode, prompt, seed)
        self.shares: list[tuple[str, bool]] = []  # (prompt, whether share_output was left to the server)
        self.in_flight = 0
        self.max_in_flight = 0

    async def check(self):
        return {"address": "fake"}

    async def send(self, item, mode, params, rec, clock):
        self.sent.append((clock(), mode, item.id, params["seed"]))
        assert params.get("share_output", None) in (None, False)  # never True: a server may not share
        self.shares.append((item.id, "share_output" not in params))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if item.id in self.fail_prompts:
                rec.status = "UNAVAILABLE"
                return
            rec.ttft, rec.e2el = self.delay / 2, self.delay
            rec.chunks = [(self.delay / 2, 1), (self.delay, 2)]
            rec.output_tokens, rec.rounds = 3, 2
            rec.ok = True
        finally:
            self.in_flight -= 1


def run(config: LoadTestConfig, client: FakeClient) -> dict:
    return asyncio.run(run_loadtest(config, client, progress=False))


def test_closed_loop_runs_every_mode_on_the_same_prompts_in_turning_order():
    client = FakeClient()
    config = LoadTestConfig(modes=["0", "4", "auto"], loads=[Load("concurrency", 1), Load("concurrency", 2)],
                            num_requests=4, warmup=2, max_tokens=8)
    result = run(config, client)
    assert len(client.sent) == 3 * 2 + 2 * 3 * 4  # warm-up, then 4 per mode and load
    assert [m for _, m, _, _ in client.sent[:6]] == ["0", "0", "4", "4", "auto", "auto"]
    records = result["records"]
    assert len(records) == 24 and all(r["ok"] for r in records)
    for run_ in result["runs"]:
        assert run_["summary"]["requests"] == 4 == sum(p["requests"] for p in run_["phases"])
        assert run_["summary"]["output_tokens"] == 12
        paired = run_["summary"]["paired_vs_k0"]  # every request matched with its twin at k = 0
        assert paired["count"] == 4 and paired["median"] == pytest.approx(1.0)
    assert sorted(r["index"] for r in records if r["load"] == "c=2" and r["mode"] == "4") == [0, 1, 2, 3]
    # c=1: blocks of 2, so two blocks, the mode order turning between them; c=2: one block of 4.
    phases = sorted((p["phase"], r["load"], r["mode"]) for r in result["runs"] for p in r["phases"])
    assert [(load, mode) for _, load, mode in phases] == [
        ("c=1", "0"), ("c=1", "4"), ("c=1", "auto"), ("c=1", "4"), ("c=1", "auto"), ("c=1", "0"),
        ("c=2", "0"), ("c=2", "4"), ("c=2", "auto")]
    measured = client.sent[6:]
    for load in ("c=1", "c=2"):
        per_mode = {m: sorted((r["prompt_id"]) for r in records if r["load"] == load and r["mode"] == m)
                    for m in ("0", "4", "auto")}
        assert per_mode["0"] == per_mode["4"] == per_mode["auto"]
        assert len(set(per_mode["0"])) == 4
    # The same request carries the same sampling seed in every mode.
    seeds = {}
    for _, mode, prompt, seed in measured:
        seeds.setdefault((prompt, seed), set()).add(mode)
    assert all(modes == {"0", "4", "auto"} for modes in seeds.values())
    assert {r["load"] for r in records} == {"c=1", "c=2"} and result["config"]["loads"][1]["value"] == 2


def test_closed_loop_keeps_its_concurrency():
    client = FakeClient(delay=0.03)
    run(LoadTestConfig(modes=["4"], loads=[Load("concurrency", 3)], num_requests=9, warmup=0), client)
    assert client.max_in_flight == 3 and len(client.sent) == 9


def test_open_loop_sends_on_the_shared_schedule():
    client = FakeClient(delay=0.2)
    config = LoadTestConfig(modes=["0", "4"], loads=[Load("rate", 20.0)], num_requests=5, block=5, warmup=0,
                            arrival="gamma", burstiness=0.5, seed=9)
    result = run(config, client)
    expected = arrival_times(5, 20.0, burstiness=0.5, seed=9 * 1_000_003)
    for mode in ("0", "4"):
        phase = next(p for r in result["runs"] if r["mode"] == mode for p in r["phases"])
        offsets = sorted(t - phase["start"] for t, m, _, _ in client.sent if m == mode)
        assert len(offsets) == 5
        for got, want in zip(offsets, expected):
            assert want - 1e-3 <= got <= want + 0.15  # never early; late only by the event loop
    assert client.max_in_flight > 1  # open loop: arrivals do not wait for answers (0.2 s each)


def test_duration_bound_runs_blocks_until_every_mode_had_its_time():
    client = FakeClient(delay=0.02)
    result = run(LoadTestConfig(modes=["0", "auto"], loads=[Load("concurrency", 1)], duration_s=0.1, warmup=0),
                 client)
    for run_ in result["runs"]:
        s = run_["summary"]
        assert s["duration_s"] >= 0.1 and s["requests"] >= 5 and s["requests"] % 2 == 0  # whole blocks of 2
    assert result["runs"][0]["summary"]["requests"] == result["runs"][1]["summary"]["requests"]


def test_failures_are_counted_not_raised():
    client = FakeClient(fail_prompts=("chat-tides", "code-sql", "grounded-question"))
    result = run(LoadTestConfig(modes=["4"], loads=[Load("concurrency", 2)], num_requests=18, warmup=0,
                                slos={"e2el": 10.0}), client)
    s = result["runs"][0]["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (18, 15, 3)
    assert s["failures"] == {"UNAVAILABLE": 3} and s["requests_meeting_slos"] == 15
    assert "chaos" not in result


def test_a_bad_config_is_refused_before_any_request():
    client = FakeClient()
    with pytest.raises(ValueError):
        run(LoadTestConfig(modes=["x"]), client)
    assert client.sent == []


def test_only_the_last_send_of_each_prompt_may_feed_the_suffix_corpus():
    """A draft learning from earlier outputs must never draft a prompt from an answer to that same
    prompt (another mode's, another load's, a warm-up's): each prompt's output may be shared once,
    at its last send; warm-ups and every earlier send say share_output=False."""
    client = FakeClient()
    config = LoadTestConfig(modes=["0", "4", "auto"], loads=[Load("concurrency", 1), Load("concurrency", 2)],
                            num_requests=4, warmup=2, max_tokens=8)
    result = run(config, client)
    assert not any(shared for _, shared in client.shares[:6])  # the warm-ups
    measured = client.shares[6:]
    prompts = {p for p, _ in measured}
    shared_at = [i for i, (_, shared) in enumerate(measured) if shared]
    assert len(shared_at) == len(prompts) == result["shared_outputs"]  # once per prompt
    for i in shared_at:  # ... and no later send of the same prompt
        assert measured[i][0] not in {p for p, _ in measured[i + 1:]}
    assert sum(r["shared_output"] for r in result["records"]) == len(prompts)


def test_a_run_bounded_by_duration_shares_no_output():
    client = FakeClient(delay=0.002)
    config = LoadTestConfig(modes=["0", "auto"], loads=[Load("concurrency", 1)], duration_s=0.05, warmup=0)
    result = run(config, client)
    assert client.shares and not any(shared for _, shared in client.shares) and result["shared_outputs"] == 0
