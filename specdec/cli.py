"""`specdec` command: start the pipeline locally, generate text, chat, check its status, stop it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import fields
from typing import TYPE_CHECKING

from specdec.errors import SpecdecError, Unauthenticated, Unavailable
from specdec.extras import SERVE_HINT, require_serving

if TYPE_CHECKING:  # the serving extra, imported where a command needs it
    from specdec.launcher import PipelineSpec

DEFAULT_ADDRESS = os.environ.get("SPECDEC_ADDRESS", "127.0.0.1:50051")
# Flags of `specdec up` whose default differs from the PipelineSpec's (one made in code starts no gateway).
UP_DEFAULTS = {"http_port": 8000}
# Flags of `specdec up` that only one proposer reads: given with another, they are refused.
PROPOSER_FLAGS = {"ngram_min": ("ngram",), "ngram_max": ("ngram",), "draft_quantize": ("model", "hybrid"),
                  "draft_quantize_group": ("model", "hybrid")}
# Flags of `specdec up` refused at once, before anything starts, unless one of these.
PLAN_CHOICES = {"proposer": ("suffix", "ngram", "model", "hybrid", "none"), "target_weights": ("auto", "gguf", "dense"),
                "draft_quantize": ("none", "int4", "int8")}


def _add_plan_flags(parser: argparse.ArgumentParser) -> None:
    from specdec.launcher import PipelineSpec

    helps = {
        "target_model": "target model: packaged default name, local directory or transformers id",
        "target_dtype": "target weight dtype", "target_threads": "torch threads of the target process",
        "draft_model": "draft model (for --proposer model or hybrid); its tokenizer must match the target's",
        "draft_dtype": "draft weight dtype", "draft_threads": "torch threads of the draft process",
        "target_weights": "the target's weights: gguf (a GGUF's quantized blocks run as stored: the packaged "
                          "default's q4_1/q8_0), dense (float weights in --target-dtype) or auto (gguf where it runs)",
        "draft_quantize": "quantize the draft model at load (--proposer model or hybrid): int4 or int8, float32 "
                          "activations; e.g. --draft-model the target's with int4 for a quantized copy of it",
        "draft_quantize_group": "weights per --draft-quantize group (a multiple of 32)",
        "target_device": "where the target runs: auto (a CUDA GPU if any, else the CPU), cpu, cuda or cuda:N",
        "draft_device": "where the draft model runs (auto, cpu, cuda or cuda:N); on one GPU both may share it",
        "proposer": "draft source: suffix (suffix speculation: the session's history and earlier outputs), ngram "
                    "(prompt lookup: the session's history), model (the draft model), hybrid (suffix speculation "
                    "when it is confident, the draft model otherwise) or none (plain decoding)",
        "draft_length": "default draft length: auto (the controller picks k per round) "
                        "or a fixed k (0 = plain decoding)",
        "ngram_min": "shortest suffix n-gram prompt lookup matches", "ngram_max": "longest suffix n-gram it matches",
        "host": "interface every service binds", "log_dir": "where the service logs go",
        "http_port": "port of the OpenAI-compatible HTTP API; 0 does not start it",
        "auth_tokens_file": "bearer tokens the orchestrator and HTTP API accept (TOKEN or NAME:TOKEN per line); "
                            "unset: open to anyone who reaches them",
        "log_format": "log lines of every service: text or json",
        "otel_endpoint": "OTLP/gRPC collector every service exports traces to (unset: no export)",
    }
    for f in fields(PipelineSpec):
        if f.name not in helps and not f.name.endswith("_port"):
            continue
        kind = int if f.type in ("int", "int | None") else str
        default = UP_DEFAULTS.get(f.name, f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind,
                            default=None if f.name in PROPOSER_FLAGS else default,  # None: not given
                            choices=PLAN_CHOICES.get(f.name),
                            help=f"{helps.get(f.name, f.name.replace('_', ' '))} (default: {default!r})")


# What stops a foreground `specdec up`: supervisors send SIGTERM (docker stop, systemd, CI runners),
# a closed terminal SIGHUP, Ctrl-C SIGINT. Each stops every process it started.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _misplaced_flags(args: argparse.Namespace) -> str:
    """Why the proposer flags given do not fit --proposer ("" when they do)."""
    misplaced = [name for name, proposers in PROPOSER_FLAGS.items()
                 if getattr(args, name, None) is not None and args.proposer not in proposers]
    if not misplaced:
        return ""
    flags = ", ".join("--" + name.replace("_", "-") for name in misplaced)
    wanted = " or ".join(PROPOSER_FLAGS[misplaced[0]])
    return (f"{flags}: options of --proposer {wanted}, which --proposer {args.proposer} does not run; drop them "
            f"or choose --proposer {wanted}")


def _prepare_models(plan: PipelineSpec) -> None:
    """Prepare `plan`'s packaged models once, with a progress bar, before the services load them: a GGUF
    is described (config, tokenizer), and converted to float32 only where dense weights will load.
    ValueError for a device this machine lacks or an unknown dtype."""
    from specdec.runtime.models import prepare_model, resolve_device, resolve_dtype

    target_dtype = resolve_dtype(plan.target_dtype, resolve_device(plan.target_device))
    draft_dtype = resolve_dtype(plan.draft_dtype, resolve_device(plan.draft_device))
    target_dense = plan.target_weights == "dense" or target_dtype != "float32"
    draft_dense = plan.proposer in ("model", "hybrid") and (plan.draft_quantize != "none" or draft_dtype != "float32")
    for spec, dense in ((plan.target_model, target_dense), (plan.draft_model, draft_dense)):
        prepare_model(spec, dense, progress=True)


def cmd_up(args: argparse.Namespace) -> int:
    require_serving("specdec up")
    from specdec.launcher import Pipeline, PipelineSpec, Stopped, state_file

    misplaced = _misplaced_flags(args)
    if misplaced:
        print(misplaced, file=sys.stderr)
        return 2
    given = {f.name: getattr(args, f.name) for f in fields(PipelineSpec) if hasattr(args, f.name)}
    plan = PipelineSpec(**{name: value for name, value in given.items()
                           if value is not None or name not in PROPOSER_FLAGS})
    if state_file().exists() and args.detach:
        print(f"a detached pipeline may already be running ({state_file()}); run `specdec down` first",
              file=sys.stderr)
        return 1
    try:
        _prepare_models(plan)
    except ValueError as exc:  # a device this machine lacks, an unknown dtype: said before anything starts
        print(f"specdec up: {exc}", file=sys.stderr)
        return 2
    pipeline = Pipeline(plan, tied_to_parent=not args.detach)

    def on_signal(signum: int, _frame) -> None:
        if pipeline.stopping.is_set():  # a second signal must not cut the shutdown short
            return
        name = signal.Signals(signum).name
        pipeline.request_stop(name)  # seen by every wait, even if the exception below is dropped
        raise Stopped(name)  # ends a sleep or a blocking call at once

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    started, up, detached = time.monotonic(), False, False
    try:  # one try from start-up on: a signal is handled wherever it lands
        pipeline.start(echo=print)  # stops what it started if it does not finish
        up = True
        print(f"pipeline up in {time.monotonic() - started:.1f}s: orchestrator at "
              f"{plan.host}:{plan.orchestrator_port}" + (f", OpenAI-compatible API at {plan.http_url()}"
                                                         if plan.http_port else ""))
        if args.detach:
            pipeline.save()
            detached = True
            print("stop it with: specdec down")
            return 0
        print("press Ctrl-C to stop")
        dead = pipeline.wait()
        print(f"process exited: {', '.join(dead)}; stopping the rest", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped) as exc:
        if not up:
            print(f"stopped during start-up ({exc or 'SIGINT'})", file=sys.stderr)
        return 0 if up else 1
    finally:
        if not detached:
            for sig in STOP_SIGNALS:  # a second signal must not cut the shutdown short
                signal.signal(sig, signal.SIG_IGN)
            pipeline.stop()


def cmd_down(args: argparse.Namespace) -> int:
    from specdec.launcher import state_file, stop_recorded

    path = state_file()
    if not path.exists():
        print("no detached pipeline is running (nothing to stop)")
        return 0
    state = json.loads(path.read_text())
    left = stop_recorded(state)
    path.unlink()
    for name in left:
        print(f"{name}: pid {state['pids'][name]} is no longer the process `specdec up` started (it exited, or "
              "the id now belongs to another process, e.g. after a reboot): left alone")
    print("pipeline stopped")
    return 0


def _client(args: argparse.Namespace, address: str | None = None):
    from specdec.client import Client

    return Client(address or args.address, timeout=args.timeout, token=args.token or None,
                  tls_ca=args.tls_ca or None, tls_cert=args.tls_cert or None, tls_key=args.tls_key or None)


def _report_error(exc: SpecdecError, args: argparse.Namespace) -> int:
    """Print what went wrong and what to do about it; the exit status for it."""
    print(f"\nerror ({exc.code}): {exc}", file=sys.stderr)
    if isinstance(exc, Unavailable) and _UNREACHABLE in str(exc):
        print(f"Nothing answers at {args.address}. Is the pipeline running? Start it with `specdec up` "
              "(or `specdec up --detach`), or point --address (or $SPECDEC_ADDRESS) at a running orchestrator.",
              file=sys.stderr)
    elif isinstance(exc, Unauthenticated):
        print("The orchestrator requires a bearer token: pass --token TOKEN or set $SPECDEC_TOKEN.", file=sys.stderr)
    elif isinstance(exc, Unavailable):
        print("A service behind the orchestrator is unavailable; `specdec status` shows which. "
              "The session is kept: retry shortly.", file=sys.stderr)
    return 2


_UNREACHABLE = "failed to connect"  # how gRPC words a refused or unresolvable address


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop or (), draft_length=args.draft_length,
                  min_p=args.min_p, presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                  min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
                  logit_bias={int(t): float(b) for t, b in (pair.split("=", 1) for pair in args.logit_bias or ())})
    grammars = [(kind, value) for kind, value in (("json_schema", args.json_schema), ("regex", args.regex),
                                                  ("choice", args.choice), ("lark", args.grammar)) if value]
    if len(grammars) > 1:
        raise SystemExit("send one of --json-schema, --regex, --choice and --grammar")
    if grammars:
        kind, value = grammars[0]
        if kind in ("json_schema", "lark") and os.path.isfile(value):
            with open(value) as f:
                value = f.read()
        if kind == "choice":
            value = json.dumps(value.split("|"))
        kwargs["grammar"] = (kind, value)
    elif args.json_object:
        kwargs["grammar"] = ("json_object", "")
    if args.logprobs is not None:
        kwargs.update(logprobs=True, top_logprobs=args.logprobs)
    return kwargs


def _summary(stats: dict, finish: str | None) -> str:
    return (f"[{stats.get('completion_tokens', 0)} tokens in {stats.get('elapsed_s', 0):.2f}s, "
            f"{stats.get('tokens_per_second', 0):.1f} tok/s, acceptance {stats.get('acceptance_rate', 0):.2f}, "
            f"mean accepted length {stats.get('mean_accepted_length', 0):.2f}, finish {finish}]")


def _stream_turn(client, args: argparse.Namespace, prompt: str | None, **kwargs):
    """Run one generation, echoing text as it arrives unless --json; returns the Generation."""
    from specdec.client import Collector

    collector = Collector()
    stream = client.stream(prompt, **kwargs)
    for chunk in stream:
        collector.add(chunk)
        if not args.json:
            print(chunk.text, end="", flush=True)
    return collector.result(stream.resumes)


def _as_json(out) -> str:
    fields = {"session_id": out.session_id, "text": out.text, "token_ids": out.token_ids,
              "finish_reason": out.finish_reason, "stats": out.stats, "resumes": out.resumes}
    if out.logprobs:
        fields["logprobs"] = [{"token_id": e.token_id, "token": e.token, "logprob": e.logprob, "rank": e.rank,
                               "top": [[t, text, v] for t, text, v in e.top]} for e in out.logprobs]
    return json.dumps(fields)


def cmd_generate(args: argparse.Namespace) -> int:
    kwargs = dict(_sampling_kwargs(args), session_id=args.session or "")
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    try:
        with _client(args) as client:
            out = _stream_turn(client, args, prompt, **kwargs)
    except SpecdecError as exc:
        return _report_error(exc, args)
    if args.json:
        print(_as_json(out))
    else:
        print()
        print(_summary(out.stats, out.finish_reason), file=sys.stderr)
    return 0


CHAT_HELP = "type a message and press Enter; /new starts a new conversation, /exit (or Ctrl-D) quits"


def cmd_chat(args: argparse.Namespace) -> int:
    """Read user turns from stdin and stream the replies, all in one session."""
    interactive = sys.stdin.isatty()
    session = args.session or ""
    if interactive and not args.json:
        print(CHAT_HELP, file=sys.stderr)
    with _client(args) as client:
        while True:
            if interactive:
                print("you> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/new":
                session = ""
                continue
            messages = [{"role": "user", "content": text}]
            if not session and args.system:
                messages.insert(0, {"role": "system", "content": args.system})
            try:
                out = _stream_turn(client, args, None, messages=messages, session_id=session, **_sampling_kwargs(args))
            except Unavailable as exc:
                return _report_error(exc, args)
            except SpecdecError as exc:  # e.g. the conversation outgrew the context: say so, keep going
                _report_error(exc, args)
                continue
            session = out.session_id
            if args.json:
                print(_as_json(out), flush=True)
            else:
                print(flush=True)
                if args.stats:
                    print(_summary(out.stats, out.finish_reason), file=sys.stderr)
    if session and not args.json:
        print(f"session {session} (continue it with: specdec chat --session {session})", file=sys.stderr)
    return 0


def _kv_summary(backend: dict) -> str:
    """`  kv 1.2 of 9.8 GiB, prefix hits 40%` for a replica that holds KV caches, else ""."""
    budget = int(backend.get("kv_cache_bytes_budget") or 0)
    if not budget:
        return ""
    used = int(backend.get("kv_cache_bytes_used") or 0)
    text = f"  kv {used / 2**30:.2f} of {budget / 2**30:.2f} GiB"
    queries = int(backend.get("prefix_cache_queries") or 0)
    if queries:
        text += f", prefix hits {int(backend.get('prefix_cache_hits') or 0) / queries:.0%}"
    return text


def _format_status(status: dict) -> list[str]:
    uptime = int(status["uptime_s"])
    lines = [
        f"orchestrator {status['address']}  healthy  specdec {status['version']}  "
        f"up {uptime // 3600}h{uptime // 60 % 60:02d}m{uptime % 60:02d}s  "
        f"default draft length {status['default_draft_length']}",
        f"  load        {status['active_generations']} generating now, {status['generations_total']} done, "
        f"{status['generated_tokens']} tokens since start",
        f"  acceptance  {status['acceptance_rate']:.2f} ({status['accepted_tokens']} of "
        f"{status['draft_tokens']} draft tokens accepted)",
    ]
    for b in status["backends"]:
        if b["healthy"]:
            weights = f"weights {b['weights']} {b.get('weights_fingerprint', '')}, " if b.get("weights") else ""
            lines.append(f"  {b['role']:<7} {b['address']:<22} healthy  {b['model']} ({b['kind']}, {b['dtype']}, "
                         f"{weights}{b.get('device') or 'cpu'})  "
                         f"rtt {b['rtt_ms']:.1f} ms{_kv_summary(b)}"
                         + ("  reads the shared outputs stream" if b.get("reads_shared_outputs") else ""))
        else:
            lines.append(f"  {b['role']:<7} {b['address']:<22} DOWN     {b['error']}")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    """GetStatus from every orchestrator address; exit 0 all healthy, 1 a backend is down, 2 unreachable."""
    from specdec.client import Endpoints

    reports, worst = [], 0
    for address in Endpoints(args.address).addresses:
        try:
            with _client(args, address) as client:
                status = client.status()
        except SpecdecError as exc:
            message = str(exc).removeprefix(f"orchestrator {address}: ")
            reports.append({"address": address, "healthy": False, "error": message})
            worst = 2
            continue
        status["healthy"] = all(b["healthy"] for b in status["backends"])
        worst = max(worst, 0 if status["healthy"] else 1)
        reports.append(status)
    if args.json:
        print(json.dumps({"orchestrators": reports}, indent=2))
    else:
        for report in reports:
            if "backends" in report:
                print("\n".join(_format_status(report)))
            else:
                print(f"orchestrator {report['address']}  UNREACHABLE  {report['error']}")
        if worst == 2:
            print("Is the pipeline running? Start it with `specdec up` (or `specdec up --detach`), "
                  "or pass --address HOST:PORT (or set $SPECDEC_ADDRESS).", file=sys.stderr)
    return worst

COMMANDS_GROUP = "specdec.commands"


def _needs_serving(name: str, missing: str):
    def run(args: argparse.Namespace) -> int:
        print(f"specdec {name} needs packages this install lacks ({missing}): {SERVE_HINT}", file=sys.stderr)
        return 2

    return run


def _add_plugin_commands(sub) -> None:
    """Subcommands that tools installed with specdec register (entry point group
    `specdec.commands`: a function that adds its parser to `sub`), e.g. `specdec loadtest` and
    `specdec draft`. The library never imports a tool: where one is not installed (a serving
    image ships only the services) its subcommand is simply absent; where its packages are
    missing (a light install) it is listed, and running it says what to install."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            add_parser = entry.load()
        except ImportError as exc:
            if not exc.name or exc.name.split(".")[0] == entry.module.split(".")[0]:
                continue  # registered by the distribution but not shipped here
            stub = sub.add_parser(entry.name, help=f"(needs {SERVE_HINT})", add_help=False)
            stub.add_argument("rest", nargs=argparse.REMAINDER)
            stub.set_defaults(func=_needs_serving(entry.name, exc.name or str(exc)))
            continue
        add_parser(sub)


def _add_pipeline_commands(sub) -> None:
    up = sub.add_parser("up", help="start Redis, draft, target and orchestrator locally "
                                   f"(needs the serve extra: {SERVE_HINT})")
    _add_plan_flags(up)
    up.add_argument("--detach", action="store_true", help="return once healthy; stop later with `specdec down`")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop a pipeline started with `specdec up --detach`")
    down.set_defaults(func=cmd_down)


def _add_address(p: argparse.ArgumentParser, timeout_default: float | None = None) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help="orchestrator address; several, comma-separated, are tried in turn "
                        f"(default: $SPECDEC_ADDRESS or {DEFAULT_ADDRESS!r})")
    p.add_argument("--timeout", type=float, default=timeout_default, help="deadline in seconds")
    p.add_argument("--token", default=os.environ.get("SPECDEC_TOKEN", ""),
                   help="bearer token for an orchestrator that requires one (default: $SPECDEC_TOKEN, "
                        "which is better: other users can read a command line)")
    p.add_argument("--tls-ca", default=os.environ.get("SPECDEC_TLS_CA", ""),
                   help="PEM CA to verify a TLS orchestrator with (default: $SPECDEC_TLS_CA; unset: plaintext)")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, for an orchestrator that asks for one")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--draft-length", default=None,
                   help="k for this request: auto, or a number (0 = plain decoding); default: the server's")
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None, help="OpenAI's, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI's, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="CTRL's (1 = off)")
    p.add_argument("--logit-bias", action="append", metavar="TOKEN=BIAS", help="repeatable")
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="return each token's log-probability and the N most likely (with --json)")
    p.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    p.add_argument("--json-schema", default=None, help="the output follows this JSON schema (text or file)")
    p.add_argument("--regex", default=None, help="the output matches this regular expression")
    p.add_argument("--choice", default=None, help="the output is one of these, separated by |")
    p.add_argument("--grammar", default=None, help="the output follows this Lark grammar (text or file)")


def _add_client_commands(sub) -> None:
    gen = sub.add_parser("generate", help="generate text, streaming it to the terminal")
    gen.add_argument("prompt")
    _add_address(gen)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    _add_sampling(gen)
    gen.add_argument("--session", default=None, help="continue this session id")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat: streams each reply, keeps the conversation in one session",
                          description=f"Reads one user message per line from stdin; {CHAT_HELP}.")
    _add_address(chat)
    _add_sampling(chat)
    chat.add_argument("--system", default=None, help="system message at the start of the conversation")
    chat.add_argument("--session", default=None, help="continue this session id")
    chat.add_argument("--stats", action="store_true", help="print a statistics line after each reply")
    chat.add_argument("--json", action="store_true", help="print one JSON object per reply instead of streaming")
    chat.set_defaults(func=cmd_chat)

    status = sub.add_parser("status", help="health, models, load and acceptance of the orchestrator and its backends")
    _add_address(status, timeout_default=10.0)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=cmd_status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plugin_commands(sub)
    _add_pipeline_commands(sub)
    _add_client_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
