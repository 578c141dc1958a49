"""vLLM (its CPU build, the real default model) with specdec's proposer drafting from a real draft
service: greedy output equal to vLLM's plain output on HumanEval and ShareGPT prompts, for suffix
speculation (with outputs learned across requests) and prompt lookup; the draft service killed
mid-generation costs no request and no token, and drafting resumes once a replica is back.

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
from pathlib import Path

import pytest

from specdec.launcher import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("SPECDEC_VLLM_PYTHON", ROOT / ".cache" / "peers" / "vllm" / "bin" / "python"))
DRIVER = Path(__file__).with_name("vllm_driver.py")
PROPOSER = "specdec.integrations.vllm.SpecdecProposer"
MAX_TOKENS = 40

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
    return path, [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


class Driver:
    """vLLM in its own interpreter (tests/system/vllm_driver.py), one generation round at a time."""

    def __init__(self, model: str, prompts: list[list[int]], spec: dict | None, env: dict, log: Path,
                 rounds: int) -> None:
        args = json.dumps({"model": model, "prompts": prompts, "spec": spec, "max_tokens": MAX_TOKENS,
                           "rounds": rounds})
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", **env}
        self.log = open(log, "wb")  # noqa: SIM115 (closed in close(), after the process)
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER), args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)

    def _line(self, key: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{") and key in line:
                return json.loads(line)
        raise RuntimeError(f"vLLM exited ({self.proc.wait()}); see {self.log.name}")

    def start_round(self) -> None:
        self._line('"ready"')
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        return self._line('"round"')

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)
        self.log.close()


def _draft(proposer: str, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--host", "127.0.0.1", "--port", str(port),
                                 "--proposer", proposer], stdout=out, stderr=subprocess.STDOUT)
    wait_healthy(f"127.0.0.1:{port}", 120, proc)
    return proc


def _spec(k: int = 4) -> dict:
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}


def _generate(model_and_prompts, tmp_path, spec, env, rounds=1) -> list[dict]:
    model, prompts = model_and_prompts
    driver = Driver(model, prompts, spec, env, tmp_path / "vllm.log", rounds)
    try:
        results = []
        for _ in range(rounds):
            driver.start_round()
            results.append(driver.result())
        return results
    finally:
        driver.close()


@pytest.fixture(scope="module")
def plain(model_and_prompts, tmp_path_factory) -> list[list[int]]:
    return _generate(model_and_prompts, tmp_path_factory.mktemp("plain"), None, {})[0]["outputs"]


def test_prompt_lookup_drafts_leave_greedy_output_unchanged(model_and_prompts, plain, tmp_path):
    port = free_port()
    draft = _draft("ngram", port, tmp_path / "draft.log")
    try:
        [result] = _generate(model_and_prompts, tmp_path, _spec(), {"SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{port}"})
    finally:
        draft.terminate()
        draft.wait(10)
    assert result["outputs"] == plain
    assert result["stats"]["calls"] > 0 and result["stats"]["failures"] == 0


def test_suffix_drafts_learn_outputs_survive_a_killed_draft_and_resume(model_and_prompts, plain, tmp_path):
    """Round 1: suffix speculation; round 2: the same prompts again, drafted from round 1's outputs
    (learned through the finished requests); round 3: the draft service killed mid-generation;
    round 4: a replica back on the same address."""
    model, prompts = model_and_prompts
    port = free_port()
    log = tmp_path / "draft.log"
    draft = _draft("suffix", port, log)
    env = {"SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{port}", "SPECDEC_DRAFT_LENGTH": "4"}
    driver = Driver(model, prompts, _spec(), env, tmp_path / "vllm.log", rounds=4)
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
