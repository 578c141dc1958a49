"""vLLM (its CPU build, the real default model) with specdec's proposer drafting from a real draft
service: greedy output equal to vLLM's plain output on HumanEval and ShareGPT prompts, for prompt
lookup, a draft model and suffix speculation (with outputs learned across requests, and shared
between two vLLM processes through two draft replicas and one Redis); sampled output following
plain vLLM's distribution (two-sample chi-square); the draft service killed mid-generation costs
no request and no token, and drafting resumes once a replica is back. Plain vLLM and the prompt
lookup one each serve several tests (one start apiece).

vLLM runs in its own virtualenv (`bench/peers.py --install vllm`, which `.ci/run` runs):
`.cache/peers/vllm`, or the interpreter $SPECDEC_VLLM_PYTHON names. Skipped, saying so, without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specdec.launcher import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("SPECDEC_VLLM_PYTHON", ROOT / ".cache" / "peers" / "vllm" / "bin" / "python"))
DRIVER = Path(__file__).with_name("vllm_driver.py")
PROPOSER = "specdec.integrations.vllm.SpecdecProposer"
MAX_TOKENS = 40
REPEATING = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat"
"""A prompt that repeats itself: prompt lookup drafts " on the log.", which the model, sampling at
temperature 1, continues with " on the" almost always and " log" about a third of the time."""
SAMPLES = 200  # continuations sampled a side
VLLM_LOSSY_WHEN_SAMPLING = ("0.32.0",)
"""vLLM releases whose CPU build, verifying drafts at temperature > 0, does not always keep its
own distribution: with its own ngram method, 400 samples of REPEATING gave " mat" as the 3rd token
181-208 times against 14 without speculation, with almost no draft accepted (see docs/vllm.md)."""
MAX_NUM_SEQS = 64  # vLLM's batch: the sampled rounds' copies of a prompt run 64 at a time

pytestmark = pytest.mark.slow


def _vllm_missing() -> str:
    if not VLLM_PYTHON.exists():
        return f"vLLM's virtualenv is absent ({VLLM_PYTHON}): python bench/peers.py --install vllm"
    found = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.util as u; print(bool(u.find_spec('vllm')))"],
                           capture_output=True, text=True)
    return "" if found.stdout.strip() == "True" else f"{VLLM_PYTHON} cannot import vllm"


@pytest.fixture(scope="module")
def model_and_prompts():
    missing = _vllm_missing()
    if missing:
        pytest.skip(missing)
    from transformers import AutoTokenizer

    from loadtest import realdata
    from specdec.runtime.models import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    items = realdata.humaneval()[:2] + realdata.sharegpt_chat(2, turns=1)[:2]
    texts = [tokenizer.apply_chat_template(item.messages(), add_generation_prompt=True, tokenize=False)
             for item in items]
    return (path, [tokenizer(text, add_special_tokens=False).input_ids for text in texts],
            tokenizer(REPEATING).input_ids)


class Driver:
    """vLLM in its own interpreter (tests/system/vllm_driver.py), one generation round at a time.

    Every driver runs vLLM on one OpenMP thread (the draft services on the other core: two pools of
    spinning threads on two shared cores starve each other), plain and speculative alike, so that
    their greedy outputs compare the same arithmetic."""

    def __init__(self, model: str, prompts: list[list[int]], spec: dict | None, env: dict, log: Path) -> None:
        args = json.dumps({"model": model, "prompts": prompts, "spec": spec, "max_tokens": MAX_TOKENS,
                           "max_num_seqs": MAX_NUM_SEQS})
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", **env}
        self.log = open(log, "wb")  # noqa: SIM115 (closed in close(), after the process)
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER), args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
        self.stats: dict = {}  # the proposer's counts after the last round

    def _line(self, key: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{") and key in line:
                return json.loads(line)
        raise RuntimeError(f"vLLM exited ({self.proc.wait()}); see {self.log.name}")

    def start_round(self, spec: dict | None = None) -> None:
        """Start a round: the default prompts, greedy; or the round `spec` names (see vllm_driver.py)."""
        self._line('"ready"')
        self.proc.stdin.write((json.dumps(spec) if spec else "go") + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        """The round's result; its "counted": the proposer's counts during that round alone."""
        result = self._line('"round"')
        result["counted"] = {key: value - self.stats.get(key, 0) for key, value in result["stats"].items()
                             if key != "acceptance"}
        self.stats = result["stats"]
        return result

    def generate(self, spec: dict | None = None) -> dict:
        self.start_round(spec)
        return self.result()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)
        self.log.close()


def _draft(proposer: str, port: int, log: Path, *args: str) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--host", "127.0.0.1", "--port", str(port),
                                 "--proposer", proposer, *args], stdout=out, stderr=subprocess.STDOUT)
    wait_healthy(f"127.0.0.1:{port}", 120, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def _spec(k: int = 4) -> dict:
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}


def _acceptance(counted: dict) -> float:
    return counted["accepted"] / counted["verified"] if counted["verified"] else 0.0


@pytest.fixture(scope="module")
def plain_vllm(model_and_prompts, tmp_path_factory):
    """vLLM without speculation: the reference of every comparison (greedy and sampled)."""
    model, prompts, _ = model_and_prompts
    driver = Driver(model, prompts, None, {}, tmp_path_factory.mktemp("plain") / "vllm.log")
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def plain(plain_vllm) -> list[list[int]]:
    return plain_vllm.generate()["outputs"]


@pytest.fixture(scope="module")
def lookup_vllm(model_and_prompts, tmp_path_factory):
    """vLLM drafting by prompt lookup from a real draft service (a longer wait than the default: the
    sampled round's steps carry dozens of requests on a shared CPU)."""
    model, prompts, _ = model_and_prompts
    logs = tmp_path_factory.mktemp("lookup")
    port = free_port()
    draft = _draft("ngram", port, logs / "draft.log")
    env = {"SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{port}", "SPECDEC_DRAFT_TIMEOUT_MS": "1000"}
    driver = Driver(model, prompts, _spec(), env, logs / "vllm.log")
    yield driver
    driver.close()
    _stop(draft)


def test_prompt_lookup_drafts_leave_greedy_output_unchanged(lookup_vllm, plain):
    result = lookup_vllm.generate()
    assert result["outputs"] == plain
    assert result["counted"]["calls"] > 0 and result["counted"]["failures"] == 0


def _two_sample_pvalue(first: list, second: list, min_expected: float = 5.0) -> float:
    """p-value of a chi-square test that two samples of categories follow one distribution; the
    categories expected fewer than `min_expected` times in either sample are pooled into one."""
    from scipy.stats import chi2_contingency

    counts = Counter(first), Counter(second)
    categories = sorted(set(counts[0]) | set(counts[1]))
    table = np.array([[c[x] for x in categories] for c in counts])  # [2, categories]
    expected = table.sum(axis=0) * table.sum(axis=1, keepdims=True) / table.sum()  # [2, categories]
    common = (expected >= min_expected).all(axis=0)
    pooled = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
    pooled = pooled[:, pooled.sum(axis=0) > 0]
    return float(chi2_contingency(pooled, correction=False).pvalue) if pooled.shape[1] > 1 else 1.0


def test_sampled_tokens_through_prompt_lookup_follow_plain_vllms_distribution(model_and_prompts, plain_vllm,
                                                                           lookup_vllm):
    """At temperature 1, the 2nd and 3rd tokens (the positions the first drafts are verified at) of
    many short continuations of a prompt that repeats itself, drafted by prompt lookup and verified
    by vLLM, follow the same distribution as plain vLLM's (two-sample chi-square)."""
    prompt = model_and_prompts[2]
    rounds = [{"prompts": [prompt] * SAMPLES, "max_tokens": 3, "temperature": 1.0,
               "seeds": list(range(offset, offset + SAMPLES))} for offset in (0, SAMPLES)]
    plain_result = plain_vllm.generate(rounds[0])
    drafted = lookup_vllm.generate(rounds[1])
    counted = drafted["counted"]
    assert counted["failures"] == 0 and counted["drafted"] > 0, counted
    pairs = [[tuple(out[1:3]) for out in result["outputs"]] for result in (plain_result, drafted)]
    pvalue = _two_sample_pvalue(*pairs)
    print(f"sampled: {SAMPLES} pairs a side, p = {pvalue:.2g}, plain {plain_result['seconds']:.1f} s, "
          f"drafted {drafted['seconds']:.1f} s, drafts {counted}")
    both = 0 < counted["vllm_accepted_tokens"] < counted["vllm_draft_tokens"]  # a wrong rule would show
    if (pvalue <= 1e-3 or not both) and drafted["version"] in VLLM_LOSSY_WHEN_SAMPLING:
        pytest.xfail(f"vLLM {drafted['version']} (CPU) verifies drafts at temperature > 0 wrongly, its own ngram "
                     f"method too (p = {pvalue:.1e}, drafts {counted}; see docs/vllm.md)")
    assert both, counted
    assert pvalue > 1e-3, (Counter(pairs[0]).most_common(8), Counter(pairs[1]).most_common(8))


def test_model_drafts_leave_greedy_output_unchanged(model_and_prompts, plain, tmp_path):
    """The draft service running the packaged model (its GGUF, one thread) as a draft model: every
    step waits for its drafts (a model draft on a shared CPU takes tens of ms a token), which vLLM
    accepts mostly, and the output is vLLM's own."""
    model, prompts, _ = model_and_prompts
    port = free_port()
    draft = _draft("model", port, tmp_path / "draft.log", "--dtype", "float32", "--threads", "1")
    env = {"SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{port}", "SPECDEC_DRAFT_LENGTH": "3",
           "SPECDEC_DRAFT_TIMEOUT_MS": "10000"}
    driver = Driver(model, prompts, _spec(3), env, tmp_path / "vllm.log")
    try:
        result = driver.generate()
    finally:
        driver.close()
        _stop(draft)
    counted = result["counted"]
    print(f"model draft: {result['seconds']:.1f} s, drafts {counted}")
    assert result["outputs"] == plain
    assert counted["failures"] == 0 and counted["drafted"] > 0
    assert _acceptance(counted) > 0.5, counted  # the same model drafts: most of its drafts hold


def test_a_second_vllm_drafts_from_the_outputs_of_the_first(model_and_prompts, plain, redis_url, tmp_path):
    """Two draft replicas sharing one suffix corpus through Redis, each serving its own vLLM: what
    vLLM A generated (through replica 1) drafts the same prompts for vLLM B (through replica 2)."""
    import redis

    from specdec.keys import suffix_outputs_key

    model, prompts, _ = model_and_prompts
    ports = free_port(), free_port()
    drafts = [_draft("suffix", port, tmp_path / f"draft{i}.log", "--suffix-redis-url", redis_url)
              for i, port in enumerate(ports)]
    store = redis.Redis.from_url(redis_url)
    store.delete(suffix_outputs_key())
    env = {"SPECDEC_DRAFT_LENGTH": "4"}
    try:
        first = Driver(model, prompts, _spec(), {**env, "SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{ports[0]}"},
                       tmp_path / "vllm-a.log")
        try:
            a = first.generate()
            # The requests that finish last are reported at the engine's next step: one more request.
            first.generate({"prompts": [prompts[0][:8]], "max_tokens": 2})
        finally:
            first.close()
        assert store.xlen(suffix_outputs_key()) >= len(prompts)
        second = Driver(model, prompts, _spec(), {**env, "SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{ports[1]}"},
                        tmp_path / "vllm-b.log")
        try:
            b = second.generate()
        finally:
            second.close()
    finally:
        for draft in drafts:
            _stop(draft)
    print(f"vLLM A: {a['seconds']:.1f} s, drafts {a['counted']}; vLLM B: {b['seconds']:.1f} s, drafts {b['counted']}")
    assert a["outputs"] == b["outputs"] == plain
    assert b["counted"]["accepted"] > a["counted"]["accepted"]
    assert _acceptance(b["counted"]) > max(_acceptance(a["counted"]), 0.5)


def test_suffix_drafts_learn_outputs_survive_a_killed_draft_and_resume(model_and_prompts, plain, tmp_path):
    """Round 1: suffix speculation; round 2: the same prompts again, drafted from round 1's outputs
    (learned through the finished requests); round 3: the draft service killed mid-generation;
    round 4: a replica back on the same address."""
    model, prompts, _ = model_and_prompts
    port = free_port()
    log = tmp_path / "draft.log"
    draft = _draft("suffix", port, log)
    env = {"SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{port}", "SPECDEC_DRAFT_LENGTH": "4"}
    driver = Driver(model, prompts, _spec(), env, tmp_path / "vllm.log")
    try:
        rounds = []
        for i in range(4):
            driver.start_round()
            if i == 2:
                time.sleep(0.5)  # the first steps drafted, then gone
                draft.send_signal(signal.SIGKILL)
                draft.wait(10)
            rounds.append(driver.result())
            if i == 2:
                draft = _draft("suffix", port, log)
    finally:
        driver.close()
        draft.terminate()
        draft.wait(10)
    (tmp_path / "rounds.json").write_text(json.dumps([{k: r[k] for k in ("seconds", "stats")} for r in rounds]))
    assert [r["outputs"] for r in rounds] == [plain] * 4
    first, second, killed, back = (r["stats"] for r in rounds)
    assert second["outputs_shared"] >= len(prompts)  # round 1's outputs joined the corpus
    accepted = second["accepted"] - first["accepted"]
    assert accepted > first["accepted"]  # and round 2 drafted from them
    assert killed["failures"] > second["failures"]  # the kill was felt, and cost no request
    assert back["accepted"] > killed["accepted"]  # drafting resumed
