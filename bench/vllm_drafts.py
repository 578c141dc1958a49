"""vLLM with specdec's drafts against vLLM plain and vLLM's own n-gram speculation, on real prompts.

    python bench/peers.py --install vllm             # once: vLLM's CPU build in a venv of its own
    python bench/vllm_drafts.py --out bench/results/vllm_drafts.json

The same vLLM server (CPU build, the packaged default model in float32) is started three times:

- `vllm`: plain decoding;
- `vllm-ngram`: vLLM's n-gram speculation (method "ngram", k = `--k`, lookup 2-3 tokens);
- `vllm-specdec`: specdec's proposer (`specdec.integrations.vllm.SpecdecProposer`, k up to `--k`,
  the policy choosing each request's length) drafting from a draft service of `--proposer`
  started beside it. Finished outputs do not join the corpus unless `--share-outputs` (the cells
  run the same prompts: an output learned in one would draft its own repeat in the next).
  `vllm-specdec+Nms` is the same with the draft service behind bench/relay.py, which delays every
  chunk by N ms each way (a draft pool on other machines), to show the draft length follow the
  round trip. The proposer drafts each request's next block during vLLM's step (the block guessed
  accepted); `-serial` after either name turns that off (SPECDEC_DRAFT_AHEAD=0): drafts in the step.

`--vllm-cpus` and `--draft-cpus` give vLLM (every server alike: its API process and its engine,
under taskset, the model's OpenMP threads bound there) and the draft service cores of their
own (`--vllm-cpus 0 --draft-cpus 1` on two cores: the draft service stands in for a draft pool on
other machines, and two OpenMP pools spinning over the same cores starve each other; docs/vllm.md).
A model draft (`--proposer model`: the packaged GGUF, run on its blocks) answers in k passes of
several ms each, so `--draft-timeout-ms` sets SPECDEC_DRAFT_TIMEOUT_MS above that.

Each is driven by bench/peers.py's streaming OpenAI client over the same HumanEval and ShareGPT
prompts at each concurrency of `--concurrency`; acceptance comes from vLLM's own spec-decode
counters (its /metrics), read before and after each cell. Outputs are compared with plain vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402 (after the path)

SERVERS = ("vllm", "vllm-ngram", "vllm-specdec")  # and vllm-specdec+Nms: the drafts N ms away each way
PROPOSER = "specdec.integrations.vllm.SpecdecProposer"


def start_server(name: str, args, logs: Path) -> peers.Server:
    """One vLLM server (and, for vllm-specdec, its draft service)."""
    from specdec.launcher import free_port, wait_healthy
    from specdec.runtime.models import resolve_model_path

    port, env, stops = peers.free_port(), {"VLLM_CPU_KVCACHE_SPACE": "4"}, []
    if args.vllm_cpus:  # one OpenMP thread per core named, bound there
        env.update({"VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpus, "OMP_NUM_THREADS": str(len(cpu_list(args.vllm_cpus)))})
    cmd = [str(peers._python("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model",
           resolve_model_path("smollm2-135m-instruct"), "--served-model-name", "smollm2", "--dtype", "float32",
           "--max-model-len", "4096", "--port", str(port), "--host", "127.0.0.1"]
    if name == "vllm-ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
        cmd += ["--speculative-config", json.dumps(spec)]
    if name.startswith("vllm-specdec"):
        delay = re.fullmatch(r"vllm-specdec(?:\+(\d+(?:\.\d+)?)ms)?(-serial)?", name)
        if delay is None:
            raise SystemExit(f"unknown server {name!r}: {', '.join(SERVERS)}, vllm-specdec+Nms or either with -serial")
        draft_port = free_port()
        draft_cmd = [sys.executable, "-m", "draft_service", "--host", "127.0.0.1", "--port", str(draft_port),
                     "--proposer", args.proposer]
        if args.draft_cpus:
            cpus = cpu_list(args.draft_cpus)
            draft_cmd = ["taskset", "-c", args.draft_cpus, *draft_cmd]
            if args.proposer in ("model", "hybrid"):
                draft_cmd += ["--threads", str(len(cpus))]
        if args.proposer in ("model", "hybrid"):
            draft_cmd += ["--dtype", "float32"]  # activations; the GGUF's weights run as its blocks
        draft = peers._process(draft_cmd, logs / f"draft-{name}.log")
        stops.append(peers._killer(draft))
        wait_healthy(f"127.0.0.1:{draft_port}", 300, draft)
        if delay.group(1):  # the proposer reaches the draft service through a relay that delays each chunk
            relay_port = free_port()
            relay = peers._process([sys.executable, str(ROOT / "bench" / "relay.py"), "--port", str(relay_port),
                                    "--upstream", f"127.0.0.1:{draft_port}", "--delay-ms", delay.group(1)],
                                   logs / f"relay-{name}.log")
            stops.insert(0, peers._killer(relay))
            wait_healthy(f"127.0.0.1:{relay_port}", 60, relay)
            draft_port = relay_port
        cmd += ["--speculative-config", json.dumps({"method": "custom_class", "model": PROPOSER,
                                                    "num_speculative_tokens": args.k})]
        env.update({"SPECDEC_DRAFT_ADDRESS": f"127.0.0.1:{draft_port}", "PYTHONPATH": str(ROOT),
                    "SPECDEC_SHARE_OUTPUTS": "1" if args.share_outputs else "0",
                    "SPECDEC_DRAFT_TIMEOUT_MS": str(args.draft_timeout_ms),
                    "SPECDEC_DRAFT_AHEAD": "0" if delay.group(2) else "1"})
    if args.vllm_cpus:  # the whole server (its API process too), not only the model's threads
        cmd = ["taskset", "-c", args.vllm_cpus, *cmd]
    proc = peers._process(cmd, logs / f"{name}.log", env)
    stops.insert(0, peers._killer(proc))
    peers._wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900)

    def stop() -> None:
        for s in stops:
            s()

    return peers.Server(name, f"http://127.0.0.1:{port}/v1", "smollm2", stop=stop)


def cpu_list(cpus: str) -> list[int]:
    """The cores of a taskset-style list ("0", "0,1", "2-3")."""
    out: list[int] = []
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def spec_counters(server: peers.Server) -> dict[str, float]:
    """vLLM's spec-decode counters (draft tokens, accepted tokens, drafts) from its /metrics."""
    url = server.url.removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    found = {}
    for key in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"):
        values = re.findall(rf"^vllm:spec_decode_{key}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        found[key] = sum(float(v) for v in values)
    return found


def cell(server: peers.Server, work: list[dict], concurrency: int, max_tokens: int) -> dict:
    before = spec_counters(server)
    result = peers.run_cell(server, work, concurrency, max_tokens)
    after = spec_counters(server)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    result.update({"draft_tokens": drafted, "accepted_tokens": accepted,
                   "acceptance": round(accepted / drafted, 3) if drafted else None})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/vllm_drafts.py", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated requests in flight")
    parser.add_argument("--prompts", type=int, default=12, help="prompts, a third of each kind")
    parser.add_argument("--offset", type=int, default=100, help="first item of each data set taken")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of both speculative servers")
    parser.add_argument("--proposer", default="suffix", choices=["suffix", "ngram", "model", "hybrid"],
                        help="the draft service's --proposer")
    parser.add_argument("--share-outputs", action="store_true", help="finished outputs join the suffix corpus")
    parser.add_argument("--vllm-cpus", default="", help="cores of every vLLM server, e.g. 0 (default: vLLM's own)")
    parser.add_argument("--draft-cpus", default="", help="cores of the draft service, e.g. 1 (default: any)")
    parser.add_argument("--draft-timeout-ms", type=float, default=50.0,
                        help="SPECDEC_DRAFT_TIMEOUT_MS (raise it for a model draft)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_drafts.json")
    args = parser.parse_args()
    if peers.available("vllm"):
        sys.exit(peers.available("vllm"))
    work = peers.prompts(args.prompts, args.offset)
    levels = [int(c) for c in args.concurrency.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="vllm-drafts-logs-"))
    results: dict[str, dict] = {}
    for name in args.servers.split(","):
        server = start_server(name, args, logs)
        try:
            cells = [cell(server, work, c, args.max_tokens) for c in levels]
        finally:
            server.stop()
        results[name] = {"cells": cells}
        print(f"{name}: " + ", ".join(f"{c['concurrency']} in flight {c['tokens_per_s']} tok/s "
                                      f"(acceptance {c['acceptance']})" for c in cells), flush=True)
    peers.compare(results, "vllm", "vllm")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpu": peers._cpu_name(), "cores": os.cpu_count(),
                                                          "load_1min_at_start": os.getloadavg()[0]},
           "max_tokens": args.max_tokens, "k": args.k, "proposer": args.proposer,
           "vllm_cpus": args.vllm_cpus, "draft_cpus": args.draft_cpus, "draft_timeout_ms": args.draft_timeout_ms,
           "prompts": [p["id"] for p in work],
           "servers": results, "command": " ".join(["python", "bench/vllm_drafts.py", *sys.argv[1:]])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out} (servers' logs in {logs})")


if __name__ == "__main__":
    main()
