"""What a passing image test shows, run inside the pod's network namespace (`run_acceptance`).

Every workload the chart renders starts and becomes ready; a CPU target runs the prebuilt native
kernels and a suffix draft reads the shared outputs stream; the chart's `helm test` Pods pass; an
OpenAI-client request through the HTTP gateway completes; with two API keys (`run --auth-secret`),
neither key reads, continues or closes the other's session, through the gateway or the
orchestrator's gRPC API, and a call without a key is refused by both; and after one workload's
container (the target by default) is killed, the next request still completes once it has been
restarted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from deploy.image_test.kubelet import Kubelet, State
from deploy.image_test.manifests import LOOPBACK, ChartPod, Container, Probe, load, translate
from deploy.image_test.podman import container_log, log, podman, prepare, run_args

KEYS_ENV = "SPECDEC_IMAGE_TEST_KEYS"  # NAME:TOKEN,NAME:TOKEN of the API keys `run --auth-secret` made


def openai_request(port: int, prompt: str, max_tokens: int, timeout_s: float, retries: int = 0) -> str:
    """One chat completion with the `openai` client; `retries`: the client's own retries of
    429/5xx answers and lost connections, with its exponential backoff (0.5 s doubling to 8 s)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{LOOPBACK}:{port}/v1", api_key=os.environ.get("SPECDEC_TOKEN", "unused"),
                    timeout=timeout_s, max_retries=retries)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0)
    usage = reply.usage
    if not reply.choices or usage is None or usage.completion_tokens < 1:
        raise RuntimeError(f"no tokens came back: {reply}")
    return f"model {model}: {reply.choices[0].message.content!r} ({usage.completion_tokens} tokens)"


def keys_of_env() -> dict[str, str]:
    """The API keys `run --auth-secret` made, by name (none without it)."""
    pairs = [item.split(":", 1) for item in os.environ.get(KEYS_ENV, "").split(",") if item]
    return {name: token for name, token in pairs}


def _http(port: int, method: str, path: str, token: str | None, body: dict | None = None,
          timeout_s: float = 120) -> tuple[int, dict]:
    """(status, JSON body) of one request to the gateway."""
    import json
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{LOOPBACK}:{port}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _expect(what: str, got: object, wanted: object) -> None:
    if got != wanted:
        raise RuntimeError(f"{what}: got {got!r}, expected {wanted!r}")


def keys_apart(gw_port: int, orchestrator: str, keys: dict[str, str], prompt: str, timeout_s: float) -> str:
    """Key bob can neither read, continue nor close a session of key alice: through the gateway, and
    through the orchestrator's gRPC API (which a pod reaches only past its NetworkPolicy: the
    orchestrator refuses it by itself); a call without a key is refused by both."""
    import grpc

    from specdec import Client, errors
    from specdec.v1 import orchestrator_pb2 as pb

    alice, bob = keys["alice"], keys["bob"]
    _expect("GET /v1/models without a key", _http(gw_port, "GET", "/v1/models", None)[0], 401)
    model = _http(gw_port, "GET", "/v1/models", alice)[1]["data"][0]["id"]
    completion = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, out = _http(gw_port, "POST", "/v1/completions", alice, completion, timeout_s)
    _expect("alice's completion", status, 200)
    session = out["specdec"]["session_id"]
    status, out = _http(gw_port, "POST", "/v1/completions", bob, {**completion, "session_id": session}, timeout_s)
    _expect("bob continuing alice's session through the gateway", (status, out["error"]["code"]),
            (404, "session_not_found"))
    with Client(orchestrator, timeout=timeout_s, max_attempts=1) as nobody:
        try:
            nobody.generate(prompt, max_new_tokens=1)
            raise RuntimeError("the orchestrator served a call without a key")
        except errors.Unauthenticated:
            pass
    with Client(orchestrator, token=bob, timeout=timeout_s, max_attempts=1) as client:
        try:
            list(client._stub(client.address).Generate(pb.GenerateRequest(session_id=session, resume_from=0),
                                                         metadata=(("authorization", f"Bearer {bob}"),),
                                                         timeout=timeout_s))
            raise RuntimeError("bob read alice's session (a resume from token 0)")
        except grpc.RpcError as exc:
            _expect("bob resuming alice's session over gRPC", exc.code(), grpc.StatusCode.NOT_FOUND)
        try:
            client.generate(" and", session_id=session, max_new_tokens=1)
            raise RuntimeError("bob continued alice's session over gRPC")
        except errors.NotFound:
            pass
        _expect("bob closing alice's session over gRPC", client.close_session(session), False)
    with Client(orchestrator, token=alice, timeout=timeout_s, max_attempts=1) as client:
        more = client.generate(" and", session_id=session, max_new_tokens=2, temperature=0)
        _expect("alice continuing her session", more.session_id, session)
        _expect("alice closing her session", client.close_session(session), True)
    return f"session {session[:8]}…: bob could not read, continue or close it; no key: refused"


def orchestrator_port(pod: ChartPod) -> int:
    """The orchestrator's gRPC port (its --port)."""
    words = next(c for c in pod.workloads if "orchestrator" in c.words and "http_gateway" not in c.words).words
    return int(words[words.index("--port") + 1]) if "--port" in words else 50051


def gateway_container(pod: ChartPod) -> tuple[Container, int] | None:
    """The HTTP gateway's container and port, if the chart renders one."""
    for c in pod.workloads:
        if "http_gateway" in c.words:
            port = next(iter(c.ports.values()), 8000)
            for i, w in enumerate(c.words[:-1]):
                if w == "--port":
                    port = int(c.words[i + 1])
            return c, port
    return None


def add_fallback_gateway(pod: ChartPod, port: int = 8000) -> tuple[Container, int]:
    """Until the chart renders a gateway: one from the orchestrator's manifest (same image, user,
    security context, env), pointed at the orchestrator's Service."""
    orch = next(c for c in pod.workloads if "orchestrator" in c.words)
    words = orch.words
    orch_port = int(words[words.index("--port") + 1]) if "--port" in words else 50051
    host = next((h for h in pod.hosts if h.startswith(orch.workload) and h.count(".") >= 3), LOOPBACK)
    gw = replace(orch, workload=f"{orch.workload}-gateway", name="gateway", component="gateway",
                 command=["python", "-m", "http_gateway"],
                 args=["--host", "0.0.0.0", "--port", str(port), "--orchestrator", f"{host}:{orch_port}"],
                 ports={"http": port}, mounts=[m for m in orch.mounts if m.path == "/tmp"],
                 probes={"readiness": Probe("tcp", port=port, period_s=2, failure_threshold=3)})
    pod.containers.insert(len(pod.workloads), gw)
    return gw, port


def draft_reads_outputs(name: str, within_s: float = 30.0) -> str:
    """The line a suffix draft logs once it reads the orchestrator's outputs stream (reached Redis and
    was let in); raises with its last stream errors if none comes within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        lines = container_log(name)
        reading = [line for line in lines if "suffix corpus: reading" in line]
        if reading:
            return reading[0].strip()
        if time.monotonic() > deadline:
            errors = [line for line in lines if "suffix outputs stream at" in line][-3:]
            raise RuntimeError(f"{name} does not read the outputs stream: {errors or 'nothing logged'}")
        time.sleep(1.0)


class Run:
    """One acceptance run: the translated chart, its containers as started, and the deadline."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.deadline = time.monotonic() + opts.timeout_s
        self.pod = translate(load(Path(opts.rendered).read_text()),
                             image_map=dict(m.split("=", 1) for m in opts.image_map))
        self.run_dir = Path(opts.run_dir)
        self.states: list[State] = []

    def _run_args(self, c: Container) -> list[str]:
        return run_args(c, pod=self.opts.pod, run_dir=self.run_dir, run_id=self.opts.run_id)

    def start(self) -> Kubelet:
        """Init containers to completion, then every workload container, under a kubelet."""
        for name, n in self.pod.replicas.items():
            if n > 1:
                log(f"{name}: {n} replicas in the chart, 1 here (they would share one loopback)")
        for c in [c for c in self.pod.workloads if c.init]:
            log(f"init container {c.id}")
            podman("run", "--rm", *self._run_args(c), timeout=600)
        for c in [c for c in self.pod.workloads if not c.init]:
            podman("run", "-d", *self._run_args(c))
            log(f"started {c.id}: {c.image} {shlex.join(c.words)[:160]}")
            self.states.append(State(c, f"{self.opts.pod}-{c.id}", started=time.monotonic()))
        kubelet = Kubelet(self.states)
        kubelet.start()
        return kubelet

    def wait_ready(self, what: str) -> None:
        while not all(s.ready for s in self.states):
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{what}: not ready in time: " + ", ".join(
                    s.container.id for s in self.states if not s.ready))
            time.sleep(0.5)

    def check_logs(self) -> None:
        """A CPU target from the image runs the prebuilt native kernels (no compiler there); a
        suffix draft reads the shared outputs stream."""
        for s in self.states:
            if s.container.component == "target":
                said = [line for line in container_log(s.name)
                        if "native kernels:" in line or "through torch's operators" in line]
                if not said or "native kernels:" not in said[0]:
                    raise RuntimeError(f"{s.container.id} runs without the native kernels: "
                                       f"{said or 'nothing logged'}")
                log(f"{s.container.id}: {said[0].strip()[-160:]}")
            if s.container.component == "draft" and "--suffix-redis-url" in (s.container.args or []):
                log(f"{s.container.id}: {draft_reads_outputs(s.name)[-160:]}")

    def helm_tests(self) -> None:
        for t in self.pod.tests:
            log(f"helm test {t.workload}: {shlex.join(t.words)}")
            proc = podman("run", "--rm", *self._run_args(t), timeout=max(10.0, self.deadline - time.monotonic()),
                          check=False)
            print(proc.stdout.strip()[-2000:], flush=True)
            if proc.returncode != 0:
                raise RuntimeError(f"helm test {t.workload} failed ({proc.returncode}): "
                                   f"{proc.stderr.strip()[-2000:]}")
            log(f"helm test {t.workload}: passed")

    def kill_and_request(self, gw_port: int) -> None:
        """Kill the chosen workload, send the next request at once, and require that it completes
        (the OpenAI client retries the 503s while the workload is down) and the workload restarted."""
        opts = self.opts
        victims = [s for s in self.states if opts.kill in (s.container.component, s.container.workload,
                                                           s.container.id)]
        if not victims:
            raise RuntimeError(f"no workload {opts.kill!r} to kill")
        for s in victims:
            pid = int(podman("inspect", "--format", "{{.State.Pid}}", s.name).stdout.strip())
            log(f"killing {s.container.id} (SIGKILL to its process {pid})")
            os.kill(pid, signal.SIGKILL)
        started, result = time.monotonic(), dict[str, Any]()

        def request() -> None:
            try:
                result["text"] = openai_request(gw_port, opts.prompt, opts.max_tokens, opts.request_timeout_s,
                                                retries=opts.retries)
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        worker = threading.Thread(target=request, daemon=True)
        worker.start()
        worker.join(timeout=max(1.0, self.deadline - time.monotonic()))
        if worker.is_alive() or "error" in result:
            raise RuntimeError(f"the request after killing {opts.kill} did not complete: "
                               f"{result.get('error', 'timed out')}")
        if any(s.restarts == 0 for s in victims):
            raise RuntimeError(f"{opts.kill} was not restarted")
        log(f"after killing {opts.kill}: {result['text']} in {time.monotonic() - started:.1f} s "
            f"(restarts: {', '.join(f'{s.container.id}={s.restarts}' for s in victims)})")


def run_acceptance(opts: argparse.Namespace) -> int:
    """Everything after the pod exists, run inside its network namespace."""
    keys = keys_of_env()
    if keys:
        os.environ["SPECDEC_TOKEN"] = keys["alice"]  # the OpenAI requests below send alice's key
    run = Run(opts)
    gw = gateway_container(run.pod)
    if gw is None:
        log("the chart renders no HTTP gateway: adding one made from the orchestrator's manifest")
        gw = add_fallback_gateway(run.pod)
    prepare(run.pod, run.run_dir)
    t0 = time.monotonic()
    kubelet = run.start()
    run.wait_ready("start")
    log(f"every workload is ready, {time.monotonic() - t0:.0f} s after the first start")
    run.check_logs()
    run.helm_tests()
    t1 = time.monotonic()
    reply = openai_request(gw[1], opts.prompt, opts.max_tokens, opts.request_timeout_s)
    log(f"OpenAI client -> gateway: {reply} in {time.monotonic() - t1:.1f} s")
    if keys:
        t1 = time.monotonic()
        apart = keys_apart(gw[1], f"{LOOPBACK}:{orchestrator_port(run.pod)}", keys, opts.prompt,
                           opts.request_timeout_s)
        log(f"two API keys: {apart} ({time.monotonic() - t1:.1f} s)")
    run.kill_and_request(gw[1])
    run.wait_ready("after the restart")
    kubelet.stop.set()
    log(f"passed in {time.monotonic() - t0:.0f} s")
    return 0
