"""Chaos during a load test: SIGKILL the draft service and start it again, then see what it cost.

The promise under test (DESIGN §4): with the draft gone, sessions go on at k = 0 with no
client-visible error, and speculation resumes once the draft is back. `DraftChaos` does the
killing (only on a pipeline the load test started itself); `recovery` reads the rounds the
clients saw and says, per kill, how many rounds fell back and how long after the new draft
process became healthy the first round speculated again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtest.metrics import Round, distribution


@dataclass
class ChaosEvent:
    killed_at: float  # seconds since the run started
    pid: int  # the draft process killed
    restarted_at: float | None = None  # the new process spawned
    healthy_at: float | None = None  # the new process answers its health check
    new_pid: int | None = None
    error: str = ""


class DraftChaos:
    """Kills the draft `every_s` seconds of its uptime (the first time `every_s` after the start)
    and starts it again on the same address, as `Pipeline` did.

    With `max_kills`, it stops after that many, and the load test runs on past its own bounds
    until speculation has resumed after the last one (`settled`), for at most `settle_timeout_s`.
    """

    def __init__(self, pipeline, every_s: float, clock: Callable[[], float], *, max_kills: int | None = None,
                 healthy_timeout_s: float = 300.0, settle_timeout_s: float = 600.0,
                 echo: Callable[[str], Any] = lambda _: None) -> None:
        if "draft" not in pipeline.procs:
            raise ValueError("the chaos option needs a pipeline with a draft service (not --proposer none)")
        if not every_s > 0:
            raise ValueError(f"the chaos interval must be positive, got {every_s}")
        if max_kills is not None and max_kills < 1:
            raise ValueError(f"max_kills must be at least 1, got {max_kills}")
        self.pipeline = pipeline
        self.every_s = every_s
        self.clock = clock
        self.max_kills = max_kills
        self.healthy_timeout_s = healthy_timeout_s
        self.settle_timeout_s = settle_timeout_s
        self.echo = echo
        self.events: list[ChaosEvent] = []
        self.last_speculated_at = float("-inf")  # the latest round seen that drafted without falling back

    def observe(self, rounds: Sequence[Round]) -> None:
        """Rounds of a finished request (the runner hands over every one)."""
        for r in rounds:
            if r.k > 0 and not r.fallback:
                self.last_speculated_at = max(self.last_speculated_at, r.at)

    def settled(self) -> bool:
        """True unless `max_kills` is set and speculation has not yet resumed after the last kill."""
        if self.max_kills is None:
            return True
        if len(self.events) < self.max_kills:
            return False
        last = self.events[-1]
        if last.error:
            return True
        if self.clock() - last.killed_at > self.settle_timeout_s:
            return True
        return last.healthy_at is not None and self.last_speculated_at >= last.healthy_at

    async def run(self, stop: asyncio.Event) -> None:
        """Kill and restart until `stop` is set or `max_kills` is reached; a restart under way is finished."""
        next_kill = self.clock() + self.every_s
        while self.max_kills is None or len(self.events) < self.max_kills:
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, next_kill - self.clock()))
                return
            except asyncio.TimeoutError:
                pass
            event = await self.kill_and_restart()
            next_kill = (event.healthy_at or self.clock()) + self.every_s

    async def kill_and_restart(self) -> ChaosEvent:
        from specdec.launcher import wait_healthy

        old = self.pipeline.procs["draft"]
        try:
            os.kill(old.pid, signal.SIGKILL)
        except ProcessLookupError:  # it died on its own: restart it all the same
            pass
        event = ChaosEvent(killed_at=self.clock(), pid=old.pid)
        self.events.append(event)
        self.echo(f"chaos: SIGKILLed the draft (pid {old.pid}) at {event.killed_at:.1f}s")
        await asyncio.to_thread(old.wait)
        try:
            proc = self._spawn()
            event.restarted_at, event.new_pid = self.clock(), proc.pid
            address = self.pipeline.plan.grpc_addresses()["draft"]
            await asyncio.to_thread(wait_healthy, address, self.healthy_timeout_s, proc)
            event.healthy_at = self.clock()
            self.echo(f"chaos: draft back (pid {proc.pid}), healthy at {event.healthy_at:.1f}s")
        except Exception as exc:  # noqa: BLE001 - reported, and the run goes on at k = 0
            event.error = f"{type(exc).__name__}: {exc}"
            self.echo(f"chaos: the draft did not come back: {event.error}")
        return event

    def _spawn(self) -> subprocess.Popen:
        """The draft's command again, logging after its previous log; the pipeline then owns it."""
        cmd = self.pipeline.plan.commands()["draft"]
        self.pipeline.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.pipeline.log_dir / "draft.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.pipeline.procs["draft"] = proc  # so Pipeline.stop() stops this one
        return proc


def recovery(events: Sequence[ChaosEvent], rounds: Sequence[Round]) -> dict[str, Any]:
    """Per kill: fallback rounds until speculation resumed, and the recovery time.

    Speculation has resumed at the first round after the new draft was healthy that asked for
    k > 0 and did not fall back (the draft answered). Recovery time: from healthy to that round.
    Rounds are attributed to the kill before them (until the next kill).
    """
    ordered = sorted(rounds, key=lambda r: r.at)
    out = []
    for i, ev in enumerate(events):
        until = events[i + 1].killed_at if i + 1 < len(events) else float("inf")
        window = [r for r in ordered if ev.killed_at <= r.at < until]
        resumed = None
        if ev.healthy_at is not None:
            resumed = next((r.at for r in window if r.at >= ev.healthy_at and r.k > 0 and not r.fallback), None)
        end = resumed if resumed is not None else until
        out.append({
            **asdict(ev),
            "resumed_at": resumed,
            "recovery_s": None if resumed is None else resumed - ev.healthy_at,
            "outage_s": None if resumed is None else resumed - ev.killed_at,
            "fallback_rounds": sum(r.fallback for r in window if r.at < end),
            "rounds_at_k0": sum(r.k == 0 or r.fallback for r in window if r.at < end),
        })
    recovered = [e for e in out if e["recovery_s"] is not None]
    return {
        "kills": len(out),
        "restarts_healthy": sum(e["healthy_at"] is not None for e in out),
        "recovered": len(recovered),
        "recovery_s": distribution(e["recovery_s"] for e in recovered),
        "outage_s": distribution(e["outage_s"] for e in recovered),
        "fallback_rounds": sum(e["fallback_rounds"] for e in out),
        "events": out,
    }
