"""The load-test loop: modes side by side, on the same prompts, interleaved in blocks.

For each load level (a closed-loop concurrency or an open-loop request rate) the request
sequence is cut into blocks. Every mode runs every block as its own *phase* (the block's
requests at that load, with that draft length), and the order of the modes turns from block to
block (A B C, B C A, C A B, ...), so slow spells of a shared machine fall on every mode alike.
Open-loop phases of one block share one arrival schedule. A mode's duration at a load is the
sum of its phases' wall times (first request sent to last response ended); throughput is
measured over that. Each phase starts from an idle server: the ramp, if any, applies to every
phase, and a closed-loop phase ends with a drain (its last requests run at falling
concurrency), which larger blocks dilute.

A multi-turn session (sharegpt-chat) is one entry of the request sequence: its turns go out one
after another, each a measured request of its own (`RequestRecord.turn`), each carrying the
earlier turns and the answers the server gave them, as a chat client does. `num_requests` then
counts sessions; a turn that fails ends its session. Shared-system sessions get a system prompt
tagged per phase (`workloads.for_phase`): the summary adds the TTFT of each phase's first
request and the median of the others (`ttft_first_s`, `ttft_rest_median_s`).

The same prompt goes out once per mode and load, so a draft that learns from earlier outputs
(suffix speculation over the orchestrator's shared stream) would otherwise draft a prompt from an
answer another mode just gave to it. `OutputSharing` prevents that: a request's output may join
that corpus only when it is the prompt's last send of the run (known ahead in a run bounded by
request count); every other request, and every warm-up, sends `share_output=False`. Each mode
still drafts from the answers to other prompts, as a server in service does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from loadtest.arrivals import arrival_times, worker_starts
from loadtest.chaos import recovery
from loadtest.metrics import (
    BASELINE,
    SLO_METRICS,
    RequestRecord,
    distribution,
    first_vs_rest_ttft,
    paired_speedups,
    summarize,
)
from loadtest.workloads import WorkItem, check_workload, for_phase, load_workload, request_order, shape_inputs


class OutputSharing:
    """Which requests' outputs may join the suffix drafts' corpus: a prompt's last send only.

    `sends` counts the measured run's sends of each request, keyed (item id, turn); None when the
    run is not known ahead (bounded by duration, or run on by chaos), and then no output is shared.
    """

    def __init__(self, sends: Counter | None) -> None:
        self.sends = sends

    @classmethod
    def plan(cls, items: list[WorkItem], config: LoadTestConfig, per_run: int | None,
             extendable: bool = False) -> OutputSharing:
        if per_run is None or config.duration_s is not None or extendable:
            return cls(None)
        sends: Counter = Counter()
        for x in itertools.islice(request_order(items, seed=config.seed), per_run):  # the same at every load
            for turn in range(x.turns):
                sends[(x.id, turn)] += len(config.modes) * len(config.loads)
        return cls(sends)

    def take(self, item_id: str, turn: int) -> bool:
        """One send of the request: whether its output may be shared (no later send repeats it)."""
        if self.sends is None:
            return False
        key = (item_id, turn)
        self.sends[key] -= 1
        return self.sends[key] == 0


def share_params(shared: bool) -> dict[str, Any]:
    """The request fields for it: unset (the server's --share-outputs) when shared, else False."""
    return {} if shared else {"share_output": False}


@dataclass(frozen=True)
class Load:
    kind: str  # "concurrency" (closed loop) or "rate" (open loop, requests per second)
    value: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"{self.value:g} req/s"


@dataclass
class LoadTestConfig:
    """One load test; the CLI maps its flags onto this and nothing else."""

    modes: list[str] = field(default_factory=lambda: ["0", "4", "auto"])  # draft lengths sent per request
    loads: list[Load] = field(default_factory=lambda: [Load("concurrency", 1)])
    num_requests: int | None = None  # per mode and load (default 12 when no duration is given)
    duration_s: float | None = None  # per mode and load: blocks go on until every mode had this long
    block: int | None = None  # requests per interleaved block (default: 2 × concurrency, or ~10 s of arrivals)
    arrival: str = "poisson"  # open loop: poisson, or gamma with `burstiness`
    burstiness: float = 1.0
    ramp_s: float = 0.0  # concurrency or rate rises linearly over this long at the start of every phase
    workload: str = "chat,grounded,code"
    input_words: int | None = None
    turns: int = 3  # sharegpt-chat: user turns per conversation (each a measured request)
    system_words: int | None = None  # shared-system: words of the shared system prompt (None: ~1,000 tokens)
    max_tokens: int = 48
    temperature: float = 0.0
    top_p: float | None = None
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    warmup: int = 1  # unmeasured requests per mode before the run
    timeout_s: float = 300.0

    def validate(self) -> None:
        if not self.modes:
            raise ValueError("give at least one mode (e.g. --modes 0,4,auto)")
        for m in self.modes:
            if m != "auto" and not (m.isdigit()):
                raise ValueError(f"a mode is auto or a draft length k >= 0, got {m!r}")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes repeat: {self.modes}")
        if not self.loads:
            raise ValueError("give at least one load (--concurrency or --rate)")
        if len({x.kind for x in self.loads}) > 1:
            raise ValueError("loads are all concurrencies (closed loop) or all request rates (open loop)")
        for load in self.loads:
            if load.kind == "concurrency" and (load.value < 1 or load.value != int(load.value)):
                raise ValueError(f"concurrency must be a whole number >= 1, got {load.value}")
            if load.kind == "rate" and not load.value > 0:
                raise ValueError(f"a request rate must be positive, got {load.value}")
            if load.kind not in ("concurrency", "rate"):
                raise ValueError(f"unknown load kind {load.kind!r}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration must be positive")
        if self.block is not None and self.block < 1:
            raise ValueError("block must be at least 1")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival is poisson or gamma, got {self.arrival!r}")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be positive")
        if self.ramp_s < 0 or self.max_tokens < 1 or self.warmup < 0 or not self.timeout_s > 0:
            raise ValueError("ramp >= 0, max_tokens >= 1, warmup >= 0 and timeout > 0, please")
        if self.turns < 1 or (self.system_words is not None and self.system_words < 1):
            raise ValueError("turns and system_words must be at least 1")
        check_workload(self.workload)  # a real-data set without its package: say what to install
        unknown = set(self.slos) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"SLOs are on {', '.join(SLO_METRICS)}; not on {', '.join(sorted(unknown))}")

    def requests_per_run(self) -> int | None:
        """Requests per mode and load when bounded by count (None: bounded by duration only)."""
        if self.num_requests is None and self.duration_s is None:
            return 12
        return self.num_requests

    def block_size(self, load: Load) -> int:
        if self.block is not None:
            return self.block
        if load.kind == "concurrency":
            return 2 * int(load.value)
        return max(4, round(load.value * 10))


def machine() -> dict[str, Any]:
    load1, load5, _ = os.getloadavg()
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
            "loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2)}


class _Progress:
    """A tqdm bar over requests (or nothing)."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", desc="loadtest", file=sys.stderr, mininterval=0.5,
                            dynamic_ncols=True)
        self.errors = 0

    def phase(self, load: Load, mode: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{load.label} k={mode} errors={self.errors}", refresh=False)

    def done(self, rec: RequestRecord) -> None:
        self.errors += not rec.ok
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_loadtest(config: LoadTestConfig, client, *, chaos_factory: Callable | None = None,
                       progress: bool = True, echo: Callable[[str], Any] = lambda _: None) -> dict[str, Any]:
    """Run the whole comparison against a client (`clients.GrpcLoadClient` or `HttpLoadClient`).

    `chaos_factory(clock)` returns a `chaos.DraftChaos` that kills and restarts the draft while
    the measured phases run. Returns the JSON-ready result (`report.write_reports` writes it).
    """
    config.validate()
    per_run = config.requests_per_run()
    items = shape_inputs(load_workload(config.workload, count=per_run, turns=config.turns,
                                       system_words=config.system_words), config.input_words, config.seed)
    server = await client.check()
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    params = {"max_new_tokens": config.max_tokens, "temperature": config.temperature, "top_p": config.top_p}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine_before = machine()

    for mode in config.modes:  # warm-up: caches, the draft-length prior, first-call costs
        for i in range(config.warmup):
            rec = RequestRecord(mode, "warmup", items[i % len(items)].id, items[i % len(items)].kind, client.api, 0.0)
            await client.send(items[i % len(items)], mode, {**params, "seed": config.seed, **share_params(False)},
                              rec, clock)
            if not rec.ok:
                echo(f"warm-up request at k={mode} failed: {rec.status} {rec.error}")

    total = None
    if per_run and config.duration_s is None:  # every load sends the same first `per_run` sessions
        requests = sum(x.turns for x in itertools.islice(request_order(items, seed=config.seed), per_run))
        total = requests * len(config.modes) * len(config.loads)
    bar = _Progress(total, progress)
    records: list[RequestRecord] = []
    runs: list[dict[str, Any]] = []
    stop = asyncio.Event()
    chaos = chaos_factory(clock) if chaos_factory else None
    sharing = OutputSharing.plan(items, config, per_run, extendable=chaos is not None)
    chaos_task = asyncio.create_task(chaos.run(stop)) if chaos else None
    measured_from = clock()
    phase_id = 0
    try:
        for li, load in enumerate(config.loads):
            order = request_order(items, seed=config.seed)  # the same prompts at every load
            size = config.block_size(load)
            spent = {m: 0.0 for m in config.modes}
            phases: dict[str, list[dict]] = {m: [] for m in config.modes}
            mine: dict[str, list[RequestRecord]] = {m: [] for m in config.modes}
            sent, b = 0, 0
            last_load = li == len(config.loads) - 1
            while True:
                n = size if per_run is None else min(size, per_run - sent)
                done = n <= 0 or (config.duration_s is not None and b > 0
                                  and all(spent[m] >= config.duration_s for m in config.modes))
                if done and last_load and chaos is not None and not chaos.settled():
                    n = size  # run on until speculation has resumed after the last kill
                elif done:
                    break
                block = [(sent + i, next(order)) for i in range(n)]
                schedule = None
                if load.kind == "rate":
                    burst = config.burstiness if config.arrival == "gamma" else 1.0
                    schedule = arrival_times(n, load.value, burstiness=burst, ramp_s=config.ramp_s,
                                             seed=config.seed * 1_000_003 + li * 10_007 + b)
                turn = b % len(config.modes)
                for mode in config.modes[turn:] + config.modes[:turn]:
                    bar.phase(load, mode)
                    recs, start, end = await _phase(client, config, load, mode, block, schedule, params, clock,
                                                    phase_id, bar, chaos, sharing)
                    spent[mode] += end - start
                    phases[mode].append({"phase": phase_id, "block": b, "start": start, "end": end,
                                         "requests": len(recs)})
                    mine[mode] += recs
                    phase_id += 1
                sent += n
                b += 1
            for mode in config.modes:
                records += mine[mode]
                summary = summarize(mine[mode], spent[mode], config.slos)
                if BASELINE in mine:
                    summary["paired_vs_k0"] = distribution(paired_speedups(mine[BASELINE], mine[mode]))
                shared = [r for r in mine[mode] if r.kind == "shared-system"]
                if shared:
                    summary.update(first_vs_rest_ttft(shared))
                runs.append({"load": load.label, "load_kind": load.kind, "load_value": load.value, "mode": mode,
                             "phases": phases[mode], "summary": summary})
    finally:
        stop.set()
        if chaos_task is not None:
            await chaos_task
        bar.close()

    result: dict[str, Any] = {
        "api": client.api, "started_at": started, "wall_s": clock(), "measured_s": clock() - measured_from,
        "config": {**asdict(config), "loads": [asdict(x) for x in config.loads]},
        "workload": {"items": len(items), "kinds": sorted({x.kind for x in items}),
                     "ids": [x.id for x in items], "turns": max(x.turns for x in items)},
        "machine": {"before": machine_before, "after": machine()},
        "server": server,
        "runs": runs,
        "shared_outputs": sum(r.shared_output for r in records),
        "records": [r.to_json() for r in records],
    }
    if chaos is not None:
        rounds = [x for r in records for x in r.round_stats]
        result["chaos"] = {"every_s": chaos.every_s, **recovery(chaos.events, rounds),
                           "errors": sum(not r.ok for r in records),
                           "failures": dict(Counter(r.status for r in records if not r.ok))}
    return result


async def _phase(client, config: LoadTestConfig, load: Load, mode: str, block: list[tuple[int, WorkItem]],
                 schedule: list[float] | None, params: dict, clock, phase_id: int, bar: _Progress, chaos,
                 sharing: OutputSharing):
    """One mode runs one block at one load: (records, start, end) on the run's clock."""
    records: list[RequestRecord] = []

    async def one(index: int, item: WorkItem) -> None:
        """One session: its turns in order, each a request carrying the answers to the ones before."""
        item = for_phase(item, phase_id)
        answers: list[str] = []
        for turn in range(item.turns):
            rec = RequestRecord(mode, load.label, item.id, item.kind, client.api, clock(), phase=phase_id,
                                index=index, turn=turn, shared_output=sharing.take(item.id, turn))
            # The same seed for the same request in every mode.
            answer = await client.send(item.at_turn(answers), mode,
                                       {**params, "seed": config.seed + index, **share_params(rec.shared_output)},
                                       rec, clock)
            records.append(rec)
            bar.done(rec)
            if chaos is not None:
                chaos.observe(rec.round_stats)
            if not rec.ok:
                break  # no answer to carry on with: the session ends, as a chat client's would
            answers.append(answer or "")

    start = clock()
    if schedule is None:  # closed loop: `concurrency` workers, each sends its next request when one ends
        queue = list(block)

        async def worker(delay: float) -> None:
            await asyncio.sleep(delay)
            while queue:
                await one(*queue.pop(0))

        starts = worker_starts(min(int(load.value), len(block)), config.ramp_s)
        await asyncio.gather(*(worker(d) for d in starts))
    else:  # open loop: requests go out on their schedule, whatever the server does
        async def at(offset: float, index: int, item: WorkItem) -> None:
            await asyncio.sleep(max(0.0, start + offset - clock()))
            await one(index, item)

        await asyncio.gather(*(at(t, i, x) for t, (i, x) in zip(schedule, block)))
    records.sort(key=lambda r: r.start)
    return records, start, clock()
