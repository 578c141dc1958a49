"""`specdec draft profile`: latency, acceptance and end-to-end speedup of candidate drafts.

Every draft source is a candidate: built drafts, the target's own copy in a dtype (bf16) or
quantized (`--copy-quantize int4,int8`: weight-only, as the draft service's `--quantize` does),
prompt lookup, suffix speculation and the hybrid of suffix speculation with a quantized copy. The
target serves the weights `--target-weights` names (`dense`: the packaged GGUF de-quantized to
float32, the full-precision stand-in). For each candidate:
- step latency: median time of one single-token decode step with a KV cache, of the model loaded
  and cached exactly as its service loads it (`load_served`: dtype, `--quantize`, engine options);
  a model-free source's: the time of one proposal per drafted position; the hybrid's: the model's
  and suffix speculation's, weighted by the share of the tokens each drafted in the simulated rounds;
- acceptance on held-out prompts, greedy, against the target's own greedy continuation:
  `agreement` (per position, the draft's next token equals the target's: the per-token α of
  `E(k) = (1 − α^(k+1)) / (1 − α)`), and simulated rounds at a fixed k through the draft
  service's own proposer (`acceptance_rate` = accepted / drafted, `mean_accepted_length` =
  accepted per round);
- `ideal_speedup`: `max_k E(k) / T(k) × T(0)` from the measured α, draft step and target verify
  times (sequential rounds, no network), the bound a perfect system reaches;
- suffix speculation's corpus (alone and in the hybrid): a replica that has served the earlier
  held-out prompts. Each prompt drafts from its own history and from the target's answers to the
  prompts before it, in order; its own answer joins the corpus after it (in process, and in the
  pipeline, where only the last run of a prompt shares its output). `suffix_corpus` in the JSON
  says so;
- end to end: a real pipeline of processes (`specdec.launcher`) per candidate, each held-out
  prompt run at k = 0, the fixed k and `auto` in turn (interleaved), speedup = median over
  prompts of tokens/s against k = 0 on the same prompt.

The models run on `--device` (auto: the first CUDA GPU if any, else the CPU), or on
`--target-device` / `--draft-device` each; the end-to-end pipelines start their services there.
Every timed step waits for the device to finish. The JSON records where each model ran.

The held-out prompts: a file (`--heldout`), the bundled set, or public data (`--heldout-set
sharegpt-chat`: ShareGPT's first human turns, open-ended chat; `humaneval`; the `bench` extra).

Writes JSON and a plot of acceptance against draft latency against speedup.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from drafts.build import REPORT_FILE, check_device
from drafts.data import TeacherData, cached_teacher_data, load_prompt_file
from specdec.core.policy import expected_tokens
from specdec.core.sampling import SamplingParams
from specdec.data import bundled_prompts
from specdec.defaults import DEFAULT_MODEL, cache_dir
from specdec.runtime.drafting import MODEL
from specdec.runtime.engine_options import QUANTIZE_GROUP
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import LoadedModel, resolve_device
from specdec.runtime.proposers import HybridProposer, LocalProposer, ModelProposer, NgramProposer

GREEDY = SamplingParams()
HELDOUT_SETS = ("bundled", "sharegpt-chat", "humaneval")
"""`--heldout-set`: the bundled prompts, ShareGPT's first human turns (open-ended chat), HumanEval."""
QUANTIZE = ("int4", "int8")
SUFFIX_CORPUS = ("the target's greedy answers to the held-out prompts before this one, in order (a replica that "
                 "has served them), besides the prompt's own history")


@dataclass
class ProfileConfig:
    """Every field is a `specdec draft profile` flag."""

    target: str = DEFAULT_MODEL
    drafts: list[str] = field(default_factory=list)  # built draft directories (or any model spec)
    copy: bool = True  # also profile the target itself in `draft_dtype` (the full default pair)
    copy_quantize: list[str] = field(default_factory=list)  # also the target's copy quantized so (int4, int8)
    copy_quantize_group: int = QUANTIZE_GROUP  # weights per group of those (the draft service's --quantize-group)
    ngram: bool = False  # also profile prompt lookup
    suffix: bool = False  # also profile suffix speculation (the draft service's defaults)
    hybrid: str = ""  # also the hybrid of suffix speculation and the copy quantized so (one of copy_quantize)
    draft_dtype: str = "bfloat16"
    target_dtype: str = "float32"
    target_weights: str = "auto"  # the target's --weights: auto, gguf or dense (a GGUF de-quantized to float32)
    k: int = 4  # fixed draft length for acceptance and the fixed-k end-to-end mode
    heldout: str | None = None  # held-out prompt file (default: `heldout_set`)
    heldout_set: str = "bundled"  # one of HELDOUT_SETS, when no file is given
    heldout_count: int = 16  # prompts taken from a public-data held-out set
    heldout_tokens: int = 64  # target greedy tokens per held-out prompt for acceptance
    top_k: int = 32  # only part of the cache key of the held-out text (shared with `draft build`)
    latency_steps: int = 24
    latency_rounds: int = 3  # every model timed this many times, in turn (median)
    threads: int | None = None  # torch threads for the in-process latency and acceptance measurements
    device: str = "auto"  # where the models run: auto, cpu, cuda or cuda:N (in process and in the pipelines)
    target_device: str | None = None  # the target's, if not `device`
    draft_device: str | None = None  # the drafts', if not `device`
    e2e: bool = True
    e2e_tokens: int = 48
    e2e_prompts: int = 8  # how many held-out prompts the end-to-end runs use
    repeats: int = 1
    target_threads: int | None = None  # pipeline processes (default: torch's choice)
    draft_threads: int | None = None
    target_cpus: str = ""  # taskset core lists for the pipeline processes (e.g. "0" and "1")
    draft_cpus: str = ""
    overlap: bool = False  # orchestrator --overlap
    ngram_min: int = 2
    ngram_max: int = 3
    out: str = "drafts-profile.json"
    plot: str | None = None  # PNG path (default: the JSON path with .png)
    cache: str | None = None
    progress: bool = True

    @property
    def target_on(self) -> str:
        return self.target_device or self.device

    @property
    def draft_on(self) -> str:
        return self.draft_device or self.device

    def validate(self) -> None:
        check_device("--device", self.device)
        for flag, value in (("--target-device", self.target_device), ("--draft-device", self.draft_device)):
            if value is not None:
                check_device(flag, value)
        if self.k < 1:
            raise ValueError("--k must be >= 1")
        if not (self.drafts or self.copy or self.copy_quantize or self.ngram or self.suffix):
            raise ValueError("nothing to profile: pass --draft DIR, --copy-quantize, --ngram or --suffix (or keep "
                             "the copy)")
        for name in ("heldout_tokens", "heldout_count", "latency_steps", "latency_rounds", "e2e_tokens",
                     "e2e_prompts", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        self._validate_sources()

    def _validate_sources(self) -> None:
        if self.heldout_set not in HELDOUT_SETS:
            raise ValueError(f"--heldout-set must be one of {', '.join(HELDOUT_SETS)}, not {self.heldout_set!r}")
        if self.heldout and self.heldout_set != "bundled":
            raise ValueError("pass --heldout FILE or --heldout-set, not both")
        for q in self.copy_quantize:
            if q not in QUANTIZE:
                raise ValueError(f"--copy-quantize takes {' and '.join(QUANTIZE)}, not {q!r}")
        if len(set(self.copy_quantize)) != len(self.copy_quantize):
            raise ValueError("--copy-quantize names a quantization twice")
        group = self.copy_quantize_group
        if group < 32 or group % 32:
            raise ValueError(f"--copy-quantize-group must be a positive multiple of 32, not {group}")
        if self.hybrid and self.hybrid not in self.copy_quantize:
            raise ValueError(f"--hybrid {self.hybrid} pairs suffix speculation with the {self.hybrid} copy: add "
                             f"--copy-quantize {self.hybrid}")
        if self.copy_quantize and resolve_device(self.draft_on).type != "cpu":
            raise ValueError("--copy-quantize: the quantized kernels run on a CPU; pass --draft-device cpu")


def _say(config: ProfileConfig, message: str) -> None:
    if config.progress:
        print(f"specdec draft profile: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- latency


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer read afterwards covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_latency_ms(caches: SessionCaches, context: list[int], steps: int) -> float:
    """Median ms of one single-token decode step after prefilling `context`."""
    sid = f"latency-{uuid.uuid4().hex}"
    history = list(context)
    caches.score(sid, history, [])  # prefill
    times = []
    for _ in range(steps + 2):
        token = int(history[-1])
        history.append(token)  # any token will do for timing
        _synchronize(caches.device)
        start = time.perf_counter()
        caches.score(sid, history, [])
        _synchronize(caches.device)
        times.append(time.perf_counter() - start)
    caches.release(sid)
    return statistics.median(times[2:]) * 1e3  # first two warm up


def verify_latency_ms(caches: SessionCaches, context: list[int], max_k: int, reps: int = 5) -> dict[int, float]:
    """Median ms for the target to score k + 1 positions (k draft tokens), for k = 0..max_k."""
    sid = f"verify-{uuid.uuid4().hex}"
    caches.score(sid, context, [])
    caches.score(sid, context, [])  # warm
    out = {}
    for k in range(max_k + 1):
        times = []
        for _ in range(reps):
            caches.rollback(sid, len(context) - 1)
            _synchronize(caches.device)
            start = time.perf_counter()
            caches.score(sid, context, [int(context[-1])] * k)
            _synchronize(caches.device)
            times.append(time.perf_counter() - start)
        out[k] = statistics.median(times) * 1e3
    caches.release(sid)
    return out


def host_latency_ms(proposer: LocalProposer, context: list[int], k: int, steps: int) -> float:
    """Median ms per drafted position of a model-free proposal of k tokens after `context` (one
    session throughout: suffix speculation indexes the context once, as a served session does)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        list(proposer.propose("latency", context, k, GREEDY, 0))
        times.append(time.perf_counter() - start)
    proposer.forget("latency", learn=False)
    return statistics.median(times) * 1e3 / k  # per drafted position


def hybrid_latency_ms(model_ms: float, suffix_ms: float, drafted_by: dict[str, int]) -> float:
    """Per drafted position: the model's step and suffix speculation's, weighted by the tokens each drafted."""
    by_model = drafted_by.get(MODEL, 0)
    total = sum(drafted_by.values())
    if not total:
        return model_ms
    return (by_model * model_ms + (total - by_model) * suffix_ms) / total


# --------------------------------------------------------------------------- acceptance


def simulate_rounds(proposer: LocalProposer, prompt: list[int], continuation: list[int], k: int) -> dict:
    """Greedy speculative rounds over the target's own continuation, as the pipeline runs them.

    Each round the draft proposes up to k tokens (never more than the tokens still wanted − 1);
    the accepted ones are its longest prefix matching the target, and the target adds one.
    `drafted_by`: the drafted tokens per source (a hybrid's model and suffix speculation).
    """
    sid = f"sim-{uuid.uuid4().hex}"
    pos = drafted = accepted = rounds = 0
    drafted_by: dict[str, int] = {}
    while pos < len(continuation):
        kk = min(k, len(continuation) - pos - 1)
        history = prompt + continuation[:pos]
        drafts = list(proposer.propose(sid, history, kk, GREEDY, 0)) if kk > 0 else []
        for draft in drafts:
            drafted_by[draft.source] = drafted_by.get(draft.source, 0) + 1
        proposals = [t.token_id for t in drafts]
        n = 0
        while n < len(proposals) and proposals[n] == continuation[pos + n]:
            n += 1
        drafted, accepted, rounds, pos = drafted + len(proposals), accepted + n, rounds + 1, pos + n + 1
    proposer.forget(sid, learn=False)
    return {"drafted": drafted, "accepted": accepted, "rounds": rounds, "tokens": len(continuation),
            "drafted_by": drafted_by}


Guesses = list[list[int | None]]
"""Per held-out sequence, per position after its prompt: the draft's one-token guess (None: none)."""


@torch.inference_mode()
def model_guesses(draft: LoadedModel, data: TeacherData) -> Guesses:
    """The draft's argmax at every position after the prompt, teacher-forced on the target's text."""
    out = []
    for tokens, start in zip(data.tokens, data.start):
        tokens = tokens.to(draft.device)  # [n]
        logits = draft.model(tokens[None, :-1]).logits[0, start:]  # [r, V]
        out.append(logits.argmax(-1).tolist())
    return out


def host_guesses(proposer: LocalProposer, data: TeacherData) -> Guesses:
    """A model-free proposer's one-token proposal at every position after the prompt (None: it
    proposes nothing there). A proposer that learns outputs learns each answer after its prompt."""
    out = []
    for n, (tokens, start) in enumerate(zip(data.tokens, data.start)):
        ids, sid = tokens.tolist(), f"agree-{n}"
        row = []
        for pos in range(start, len(ids) - 1):
            got = [t.token_id for t in proposer.propose(sid, ids[: pos + 1], 1, GREEDY, 0)]
            row.append(got[0] if got else None)
        out.append(row)
        proposer.forget(sid, learn=False)
        proposer.add_output(ids[start + 1:])
    return out


def hybrid_guesses(suffix: Guesses, model: Guesses) -> Guesses:
    """The hybrid's guess: suffix speculation's where it proposes, the model's elsewhere."""
    return [[s if s is not None else m for s, m in zip(rs, rm)] for rs, rm in zip(suffix, model)]


def agreement(guesses: Guesses, data: TeacherData) -> float:
    """Per position: the guess equals the target's greedy token (no guess = a miss): the per-token α."""
    hits = total = 0
    for row, tokens, start in zip(guesses, data.tokens, data.start):
        truth = tokens[start + 1:].tolist()
        assert len(row) == len(truth), (len(row), len(truth))
        hits += sum(g == t for g, t in zip(row, truth))
        total += len(truth)
    return hits / max(total, 1)


def acceptance(proposer: LocalProposer, data: TeacherData, k: int) -> dict:
    """Simulated rounds at k over every held-out sequence, in order (a proposer that learns outputs
    learns each answer after its prompt)."""
    totals = {"drafted": 0, "accepted": 0, "rounds": 0, "tokens": 0}
    drafted_by: dict[str, int] = {}
    for tokens, start in zip(data.tokens, data.start):
        ids = tokens.tolist()
        got = simulate_rounds(proposer, ids[: start + 1], ids[start + 1:], k)
        proposer.add_output(ids[start + 1:])
        for key in totals:
            totals[key] += got[key]
        for source, n in got["drafted_by"].items():
            drafted_by[source] = drafted_by.get(source, 0) + n
    return {
        "k": k, **totals, "drafted_by": drafted_by,
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
        "mean_accepted_length": totals["accepted"] / max(totals["rounds"], 1),
        "tokens_per_round": totals["tokens"] / max(totals["rounds"], 1),
    }


def ideal_speedup(alpha: float, draft_ms: float, verify_ms: dict[int, float]) -> tuple[float, int]:
    """max_k E(k) / T(k) × T(0) with T(k) = k·t_d + t_v(k): sequential rounds, no network."""
    best, best_k = 1.0, 0
    for k, tv in verify_ms.items():
        if k == 0:
            continue
        rate = expected_tokens(alpha, k) / (k * draft_ms + tv) * verify_ms[0]
        if rate > best:
            best, best_k = rate, k
    return best, best_k


# --------------------------------------------------------------------------- end to end


def _summarise(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["elapsed_s"] for r in runs)
    drafted = sum(r["draft_tokens"] for r in runs)
    accepted = sum(r["accepted_tokens"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    return {
        "tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3) if seconds else None,
        "median_prompt_tokens_per_s": round(statistics.median(r["tokens"] / r["elapsed_s"] for r in runs), 3),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_tokens_per_round": round(tokens / rounds, 3) if rounds else None,
        "identical_to_target_greedy": all(r["identical"] for r in runs),
    }


def _same_prefix(a: list[int], b: list[int]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


LEARNS_OUTPUTS = ("suffix", "hybrid")
"""The candidate kinds whose draft learns finished outputs (suffix speculation's corpus)."""


def pipeline_spec(candidate: dict, config: ProfileConfig, log_dir: str):
    """The `specdec.launcher.PipelineSpec` of one candidate's pipeline, on free ports."""
    from specdec.launcher import PipelineSpec, free_port

    return PipelineSpec(target_model=config.target, target_dtype=config.target_dtype,
                        target_threads=config.target_threads, target_device=config.target_on,
                        target_weights=config.target_weights, proposer=candidate["kind"],
                        draft_model=candidate.get("model", config.target), draft_dtype=config.draft_dtype,
                        draft_quantize=candidate.get("quantize", "none"),
                        draft_quantize_group=candidate.get("quantize_group", QUANTIZE_GROUP),
                        draft_threads=config.draft_threads, draft_device=config.draft_on, draft_length="auto",
                        ngram_min=config.ngram_min, ngram_max=config.ngram_max, target_cpus=config.target_cpus,
                        draft_cpus=config.draft_cpus, log_dir=log_dir,
                        extra_orchestrator_args=["--overlap"] if config.overlap else [],
                        orchestrator_port=free_port(), draft_port=free_port(), target_port=free_port(),
                        redis_port=free_port())


def shares_output(kind: str, mode: str, modes: list[str]) -> bool | None:
    """A run's `share_output`: for a draft that learns outputs, only the last run of a prompt shares
    its output, so that the prompt's own answer drafts none of its runs and the later prompts' do;
    None (the server's default) for the others, which keep no corpus."""
    if kind not in LEARNS_OUTPUTS:
        return None
    return mode == modes[-1]


def end_to_end(candidate: dict, config: ProfileConfig, prompts: list[dict], reference: dict[str, list[int]],
               log_root: Path) -> tuple[dict, dict[str, str], dict[str, dict]]:
    """A real pipeline for one candidate; every prompt at k = 0, fixed k and auto, interleaved.

    Returns the runs per mode, the devices the services report by role, and what they serve (kind,
    weights, whether the draft reads the shared outputs)."""
    from specdec import Client
    from specdec.launcher import Pipeline

    plan = pipeline_spec(candidate, config, tempfile.mkdtemp(prefix=f"{candidate['name']}-", dir=log_root))
    pipeline = Pipeline(plan)
    pipeline.start(echo=lambda *_: None)
    modes = ["0", str(config.k), "auto"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    kind = candidate["kind"]
    try:
        with Client(plan.grpc_addresses()["orchestrator"]) as client:
            backends = client.status(timeout=30)["backends"]
            devices = {b["role"]: b.get("device", "") for b in backends}
            served = {b["role"]: {key: b.get(key) for key in ("kind", "weights", "reads_shared_outputs")}
                      for b in backends}
            client.generate("Warm up.", max_new_tokens=8, draft_length="auto",
                            share_output=False if kind in LEARNS_OUTPUTS else None)
            for repeat in range(config.repeats):
                for item in prompts:
                    request = {"messages": item["messages"]} if "messages" in item else {"prompt": item["prompt"]}
                    for mode in modes:
                        share = shares_output(kind, mode, modes)
                        out = client.generate(**request, max_new_tokens=config.e2e_tokens, share_output=share,
                                              draft_length=mode if mode == "auto" else int(mode))
                        if share:
                            time.sleep(0.5)  # the draft replica reads the shared output from Redis's stream
                        s = out.stats
                        expected = reference.get(item["id"])
                        runs[mode].append({
                            "prompt": item["id"], "repeat": repeat, "tokens": s["completion_tokens"],
                            "elapsed_s": s["elapsed_s"], "rounds": s["rounds"], "draft_tokens": s["draft_tokens"],
                            "accepted_tokens": s["accepted_tokens"],
                            "identical": expected is None or _same_prefix(out.token_ids, expected),
                        })
                        _say(config, f"{candidate['name']:>18} k={mode:<4} {item['id']:18} "
                                     f"{s['completion_tokens'] / s['elapsed_s']:6.2f} tok/s")
    finally:
        pipeline.stop()
    result = {m: {"summary": _summarise(r), "runs": r} for m, r in runs.items()}
    base = {(r["prompt"], r["repeat"]): r["tokens"] / r["elapsed_s"] for r in runs["0"]}
    for mode in modes[1:]:
        ratios = [(r["tokens"] / r["elapsed_s"]) / base[(r["prompt"], r["repeat"])] for r in runs[mode]]
        total = result[mode]["summary"]["tokens_per_s"] / result["0"]["summary"]["tokens_per_s"]
        result[mode]["speedup"] = round(statistics.median(ratios), 3)
        result[mode]["speedup_total"] = round(total, 3)
    return result, devices, served


# --------------------------------------------------------------------------- the whole profile


def copy_name(quantize: str, group: int) -> str:
    """A quantized copy's candidate name: its --quantize and --quantize-group (`int4g128`)."""
    return f"target-copy-{quantize}g{group}"


def candidates_of(config: ProfileConfig) -> list[dict]:
    """The candidates the config asks for, in the order they are measured and plotted."""
    out = []
    for spec in config.drafts:
        report_path = Path(spec).expanduser() / REPORT_FILE
        report = json.loads(report_path.read_text()) if report_path.is_file() else None
        name = f"distilled-L{report['depth']}" if report else Path(spec).name
        if any(c["name"] == name for c in out):
            name = f"{name}-{Path(spec).name}"
        out.append({"name": name, "kind": "model", "model": spec, "trained": report is not None,
                    "build": _build_summary(report) if report else None})
    untrained = {"model": config.target, "trained": False, "build": None}
    if config.copy:
        out.append({"name": f"target-copy-{config.draft_dtype}", "kind": "model", **untrained})
    group = config.copy_quantize_group
    for q in config.copy_quantize:
        out.append({"name": copy_name(q, group), "kind": "model", "quantize": q, "quantize_group": group,
                    **untrained})
    if config.ngram:
        out.append({"name": "prompt-lookup", "kind": "ngram", **untrained})
    if config.suffix:
        out.append({"name": "suffix", "kind": "suffix", "suffix_corpus": SUFFIX_CORPUS, **untrained})
    if config.hybrid:
        out.append({"name": f"hybrid-suffix+{config.hybrid}g{group}", "kind": "hybrid", "quantize": config.hybrid,
                    "quantize_group": group, "pairs_with": copy_name(config.hybrid, group),
                    "suffix_corpus": SUFFIX_CORPUS, **untrained})
    return out


def _build_summary(report: dict) -> dict:
    keys = ("layers", "depth", "strategy", "width", "parameters", "data", "training", "heldout")
    summary = {k: report.get(k) for k in keys}
    if summary.get("training"):
        summary["training"] = {k: v for k, v in summary["training"].items() if k != "loss_curve"}
    return summary


def heldout_prompts(config: ProfileConfig) -> list[dict]:
    """The held-out prompts: the file, the bundled set, or `heldout_count` items of a public data set
    (ShareGPT's first human turns as one-turn chats; HumanEval's problems as posed)."""
    if config.heldout:
        return load_prompt_file(config.heldout)
    if config.heldout_set == "bundled":
        return bundled_prompts()
    from loadtest import realdata  # public data (the `bench` extra), only when asked for

    items = realdata.build(config.heldout_set, config.heldout_count, turns=1)[: config.heldout_count]
    return [{"id": item.id, "messages": item.messages()} for item in items]


def target_config(config: ProfileConfig):
    """The target service's config for the profiled target (`load_served` loads it as served)."""
    from target_service.config import TargetConfig

    return TargetConfig(model=config.target, dtype=config.target_dtype, weights=config.target_weights,
                        threads=config.threads, device=config.target_on, max_sessions=4)


def draft_config(config: ProfileConfig, cand: dict):
    """The draft service's config for a model candidate (`load_served` loads it as served): a quantized
    copy takes `--quantize` and float32 activations, as `specdec.launcher` starts it."""
    from draft_service.config import DraftConfig

    fields = {"proposer": "model", "model": cand["model"], "threads": config.threads, "device": config.draft_on,
              "max_sessions": 4}
    if cand.get("quantize"):
        fields.update(quantize=cand["quantize"], quantize_group=cand["quantize_group"])
        if config.draft_dtype in ("float32", "float64"):
            fields["dtype"] = config.draft_dtype
    else:
        fields["dtype"] = config.draft_dtype
    return DraftConfig(**fields)


def _load_served(service_config, role: str) -> tuple[LoadedModel, SessionCaches]:
    from specdec.server.model_service import load_served
    from specdec.server.serving import StartupError

    try:
        return load_served(service_config, role)
    except StartupError as exc:  # what this model or machine cannot serve: the CLI's exit 2
        raise ValueError(str(exc)) from exc


def suffix_speculation() -> LocalProposer:
    """A fresh suffix proposer as the draft service builds it by default (no corpus yet)."""
    from draft_service.config import DraftConfig
    from draft_service.registry import suffix_proposer

    return suffix_proposer(DraftConfig(proposer="suffix"))


def _weights_of(loaded: LoadedModel) -> dict:
    return {"dtype": str(loaded.dtype).removeprefix("torch."), "weights": loaded.weights.format,
            "weights_fingerprint": loaded.weights.fingerprint, "device": loaded.describe_device()}


def measure_candidate(cand: dict, config: ProfileConfig, models: dict[str, tuple[LoadedModel, SessionCaches]],
                      latency: dict[str, list[float]], heldout: TeacherData, context: list[int],
                      guesses: dict[str, Guesses]) -> None:
    """Step latency, agreement and simulated acceptance of one candidate, into `cand`; `guesses`
    keeps each model's teacher-forced guesses for a hybrid that pairs with it."""
    kind, k = cand["kind"], config.k
    if kind == "model":
        loaded, caches = models[cand["name"]]
        guesses[cand["name"]] = model_guesses(loaded, heldout)
        cand["step_ms"] = statistics.median(latency[cand["name"]])
        cand["step_ms_samples"] = [round(v, 3) for v in latency[cand["name"]]]
        cand["agreement"] = agreement(guesses[cand["name"]], heldout)
        cand["acceptance"] = acceptance(ModelProposer(caches), heldout, k)
        cand.update(_weights_of(loaded))
    elif kind == "hybrid":
        loaded, caches = models[cand["pairs_with"]]
        cand["acceptance"] = acceptance(HybridProposer(ModelProposer(caches), suffix_speculation()), heldout, k)
        suffix = host_guesses(suffix_speculation(), heldout)
        cand["agreement"] = agreement(hybrid_guesses(suffix, guesses[cand["pairs_with"]]), heldout)
        cand["suffix_guess_share"] = sum(g is not None for row in suffix for g in row) / heldout.teacher_positions
        cand["model_step_ms"] = statistics.median(latency[cand["pairs_with"]])
        cand["suffix_step_ms"] = host_latency_ms(suffix_speculation(), context, k, config.latency_steps)
        cand["step_ms"] = hybrid_latency_ms(cand["model_step_ms"], cand["suffix_step_ms"],
                                            cand["acceptance"]["drafted_by"])
        cand.update(_weights_of(loaded))
    else:  # prompt lookup or suffix speculation: each measurement on a fresh proposer (a fresh corpus)
        fresh = ((lambda: NgramProposer(config.ngram_max, config.ngram_min)) if kind == "ngram"
                 else suffix_speculation)
        cand["step_ms"] = host_latency_ms(fresh(), context, k, config.latency_steps)
        cand["agreement"] = agreement(host_guesses(fresh(), heldout), heldout)
        cand["acceptance"] = acceptance(fresh(), heldout, k)
        cand.update(dtype="none", weights="none", device="cpu")  # computed on the host


def time_models(timed: dict[str, SessionCaches], context: list[int], config: ProfileConfig) -> dict[str, list[float]]:
    """Every model's step latency, `latency_rounds` times each, in turn: load from other processes
    falls on all of them alike (the ratios matter, not the absolute ms)."""
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(config.latency_rounds):
        for name, caches in timed.items():
            samples[name].append(step_latency_ms(caches, context, config.latency_steps))
    return samples


def profile_drafts(config: ProfileConfig) -> dict:
    config.validate()
    started = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    prompts = heldout_prompts(config)
    target, target_caches = _load_served(target_config(config), "target")
    target_device, target_weights = target.describe_device(), _weights_of(target)
    cache = Path(config.cache).expanduser() if config.cache else cache_dir() / "drafts"
    heldout, _ = cached_teacher_data(cache, target, prompts=prompts, invent=0, max_new_tokens=config.heldout_tokens,
                                     top_k=config.top_k, sampled_fraction=0.0, seed=0, batch_size=1,
                                     progress=config.progress, kind="heldout")
    reference = {p["id"]: t[s + 1:].tolist() for p, t, s in zip(heldout.prompts, heldout.tokens, heldout.start)}
    context = heldout.tokens[0][: heldout.start[0] + 1].tolist()  # a held-out prompt

    candidates = candidates_of(config)
    models: dict[str, tuple[LoadedModel, SessionCaches]] = {}
    for cand in candidates:
        if cand["kind"] == "model":  # every model loaded at once, then timed in turn
            models[cand["name"]] = _load_served(draft_config(config, cand), "draft")
            if models[cand["name"]][0].fingerprint != target.fingerprint:
                raise ValueError(f"{cand['model']} does not share the target's tokenizer")
    samples = time_models({"target": target_caches, **{name: caches for name, (_, caches) in models.items()}},
                          context, config)
    target_step = statistics.median(samples["target"])
    verify = verify_latency_ms(target_caches, context, max(config.k, 8))
    _say(config, f"target {config.target} ({target_weights['weights']}, {target_device}): step {target_step:.1f} ms, "
                 "verify k+1 " + " ".join(f"{k}:{v:.0f}" for k, v in verify.items()) + " ms")
    target_layers = target.model.config.num_hidden_layers
    del target, target_caches

    guesses: dict[str, Guesses] = {}
    for cand in candidates:
        measure_candidate(cand, config, models, samples, heldout, context, guesses)
        cand["latency_ratio"] = cand["step_ms"] / target_step
        cand["ideal_speedup"], cand["ideal_k"] = ideal_speedup(cand["agreement"], cand["step_ms"], verify)
        _say(config, f"{cand['name']}: step {cand['step_ms']:.2f} ms ({cand['latency_ratio']:.3f}× target), "
                     f"agreement {cand['agreement']:.3f}, acceptance@k={config.k} "
                     f"{cand['acceptance']['acceptance_rate']:.3f}, ideal {cand['ideal_speedup']:.2f}×")
    del models, guesses
    gc.collect()
    if torch.cuda.is_available():  # the pipelines' services need the GPU memory the in-process models held
        torch.cuda.empty_cache()

    e2e_prompts = heldout.prompts[: config.e2e_prompts]
    if config.e2e:
        log_root = Path(tempfile.mkdtemp(prefix="specdec-profile-"))
        for cand in candidates:
            cand["e2e"], cand["e2e_devices"], cand["e2e_served"] = end_to_end(cand, config, e2e_prompts, reference,
                                                                              log_root)
            e = cand["e2e"]
            _say(config, f"{cand['name']}: k=0 {e['0']['summary']['median_prompt_tokens_per_s']:.2f} tok/s, "
                         f"k={config.k} ×{e[str(config.k)]['speedup']:.2f}, auto ×{e['auto']['speedup']:.2f}")

    result = {
        "target": {"model": config.target, **target_weights, "step_ms": target_step,
                   "step_ms_samples": [round(v, 3) for v in samples["target"]], "verify_ms": verify,
                   "layers": target_layers},
        "heldout": {"set": "file" if config.heldout else config.heldout_set,
                    "prompts": [p["id"] for p in heldout.prompts], "positions": heldout.teacher_positions,
                    "tokens_per_prompt": config.heldout_tokens},
        "e2e_prompts": [p["id"] for p in e2e_prompts] if config.e2e else [],
        "candidates": candidates,
        "goal": judge(candidates, config.k) if config.e2e else None,
        "config": asdict(config),
        "machine": {"target_device": target_device,
                    "draft_device": next((c["device"] for c in candidates if c["kind"] == "model"), "cpu"),
                    "cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "seconds": round(time.perf_counter() - started, 1),
    }
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot_path = Path(config.plot) if config.plot else out.with_suffix(".png")
    plot_profile(result, plot_path)
    _say(config, f"wrote {out} and {plot_path}")
    return result


def best_speedup(cand: dict, k: int) -> float:
    e = cand.get("e2e") or {}
    return max((e[m]["speedup"] for m in (str(k), "auto") if m in e), default=float("nan"))


def judge(candidates: list[dict], k: int, latency_goal: float = 0.25, acceptance_goal: float = 0.6) -> dict:
    """The goal per trained draft: latency ≤ 0.25 × target step, acceptance ≥ 0.6, and an
    end-to-end speedup above every draft that needs no training."""
    untrained = [c for c in candidates if not c["trained"]]
    bar = max((best_speedup(c, k) for c in untrained), default=0.0)
    verdicts = {}
    for c in candidates:
        if not c["trained"]:
            continue
        speed = best_speedup(c, k)
        verdicts[c["name"]] = {
            "latency_ratio": round(c["latency_ratio"], 3), "latency_ok": c["latency_ratio"] <= latency_goal,
            "agreement": round(c["agreement"], 3), "acceptance_ok": c["agreement"] >= acceptance_goal,
            "speedup": speed, "best_untrained_speedup": bar, "speedup_ok": speed > bar,
        }
        verdict = verdicts[c["name"]]
        verdict["reached"] = all(verdict[f"{x}_ok"] for x in ("latency", "acceptance", "speedup"))
    return {"criteria": {"latency_ratio_max": latency_goal, "agreement_min": acceptance_goal,
                         "speedup": "best of fixed k and auto, above every untrained candidate's best"},
            "drafts": verdicts, "reached_by": [n for n, v in verdicts.items() if v["reached"]]}


def plot_profile(result: dict, path: Path) -> None:
    """Left: acceptance against draft latency, colour = end-to-end speedup (the paper's figure).
    Right: end-to-end speedup per candidate (fixed k, auto) next to the modelled ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = sorted(result["candidates"], key=lambda c: c["latency_ratio"])
    k = result["config"]["k"]
    has_e2e = all("e2e" in c for c in cands)
    fig, axes = plt.subplots(1, 2 if has_e2e else 1, figsize=(13 if has_e2e else 6.5, 5), squeeze=False)
    ax = axes[0][0]
    colour = [best_speedup(c, k) for c in cands] if has_e2e else [c["ideal_speedup"] for c in cands]
    norm = matplotlib.colors.Normalize(vmin=min(colour + [1.0]) - 0.05, vmax=max(colour + [1.0]) + 0.05)
    markers = "osD^vPX*hp"
    for i, (c, ci) in enumerate(zip(cands, colour)):
        ax.scatter([c["latency_ratio"]], [c["agreement"]], c=[ci], cmap="viridis", norm=norm, s=130,
                   marker=markers[i % len(markers)], edgecolors="black", zorder=3,
                   label=f"{c['name']}: {c['latency_ratio']:.2f}×, α {c['agreement']:.2f}, {ci:.2f}× speed")
    ax.axvline(0.25, color="grey", ls=":", lw=1)
    ax.axhline(0.6, color="grey", ls=":", lw=1)
    ax.set_xlim(-0.03, max(c["latency_ratio"] for c in cands) * 1.1 + 0.05)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft step latency / target step latency")
    ax.set_ylabel("acceptance α (greedy, per token, held-out)")
    ax.legend(fontsize=7, loc="center right")
    fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap="viridis"), ax=ax,
                 label="end-to-end speedup (best of fixed k, auto)" if has_e2e else "ideal speedup")
    ax.set_title("acceptance vs draft latency (dotted: the goal)")
    if has_e2e:
        ax = axes[0][1]
        xs = range(len(cands))
        width = 0.27
        bars = [(f"k = {k}", [c["e2e"][str(k)]["speedup"] for c in cands]),
                ("auto", [c["e2e"]["auto"]["speedup"] for c in cands]),
                ("ideal (sequential model)", [c["ideal_speedup"] for c in cands])]
        for j, (label, values) in enumerate(bars):
            ax.bar([x + (j - 1) * width for x in xs], values, width, label=label)
        ax.axhline(1.0, color="grey", ls="--", lw=1)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{c['name']}\n{c['latency_ratio']:.2f}× latency" for c in cands], fontsize=7)
        ax.set_ylabel("speedup vs k = 0 (median over prompts)")
        ax.set_ylim(0, max(max(v) for _, v in bars) * 1.2)
        ax.legend(fontsize=8, loc="upper center", ncol=3)
        ax.set_title("end-to-end speedup (real pipeline) per draft")
    target = result["target"]
    machine = result["machine"]
    where = machine.get("target_device", "cpu")
    where = f"{machine['cpus']} torch thread(s)" if where == "cpu" else where
    fig.suptitle(f"drafts for {target['model']} ({target.get('weights', target['dtype'])}, step "
                 f"{target['step_ms']:.0f} ms; held-out: {result['heldout'].get('set', 'file')}) on "
                 f"{machine['platform'].split('-')[0]}, {where}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
