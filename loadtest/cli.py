"""`specdec loadtest`: flags mapped onto `LoadTestConfig`, the server found or started, reports written.

    specdec up --detach
    specdec loadtest --modes 0,4,auto --concurrency 1,2,4 --num-requests 12 --slo ttft=2 --slo tpot=0.2
    specdec loadtest --api http --rate 0.2,0.5 --arrival gamma --burstiness 0.5 --duration 60
    specdec loadtest --start-pipeline --chaos-kill-draft-every 20 --chaos-kills 2 --modes auto --duration 60
    specdec loadtest --workload sharegpt-chat --turns 3 --num-requests 8    # pip install 'specdec[bench]'
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
import time

from loadtest.metrics import parse_slo
from specdec.extras import require_serving

DEFAULT_ADDRESS = os.environ.get("SPECDEC_ADDRESS", "127.0.0.1:50051")
DEFAULT_HTTP = "http://127.0.0.1:8000/v1"
DEFAULT_OUT = "loadtest-report"


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _slo(text: str) -> tuple[str, float]:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.launcher import PipelineSpec

    where = p.add_argument_group("where")
    where.add_argument("--api", choices=("grpc", "http"), default="grpc", help="which API to drive (default: grpc)")
    where.add_argument("--address", default=DEFAULT_ADDRESS,
                       help=f"orchestrator gRPC address(es) (default: $SPECDEC_ADDRESS or {DEFAULT_ADDRESS})")
    where.add_argument("--http-url", default=DEFAULT_HTTP, help=f"OpenAI-compatible base URL (default: {DEFAULT_HTTP})")
    where.add_argument("--start-pipeline", action="store_true",
                       help="start the `specdec up` pipeline (defaults, free ports) for the run and stop it after")
    where.add_argument("--proposer", default=PipelineSpec.proposer,
                       choices=("suffix", "ngram", "model", "hybrid", "none"),
                       help="with --start-pipeline: the draft source, as `specdec up --proposer` "
                            f"(default {PipelineSpec.proposer})")
    where.add_argument("--target-model", default=None, help="with --start-pipeline: the target model")
    where.add_argument("--draft-model", default=None, help="with --start-pipeline: the draft model (--proposer model)")
    where.add_argument("--target-args", default="", metavar="FLAGS",
                       help="with --start-pipeline: extra flags for the target service, one string "
                       "(e.g. \"--kernels torch --prefill-chunk-tokens 256\")")
    where.add_argument("--log-dir", default="",
                       help="with --start-pipeline: where service logs go (default: a temp dir)")

    load = p.add_argument_group("load")
    kind = load.add_mutually_exclusive_group()
    kind.add_argument("--concurrency", type=_floats, default=None,
                      help="closed loop: requests in flight, one or a comma list of levels (default: 1)")
    kind.add_argument("--rate", type=_floats, default=None,
                      help="open loop: arrivals per second, one or a comma list of levels")
    load.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson",
                      help="open-loop arrivals: poisson, or gamma with --burstiness")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular (default 1)")
    load.add_argument("--ramp", type=float, default=0.0, dest="ramp_s",
                      help="seconds over which concurrency or rate rises linearly at the start of every phase")
    load.add_argument("--num-requests", type=int, default=None,
                      help="requests per mode and load level (default 12 unless --duration)")
    load.add_argument("--duration", type=float, default=None, dest="duration_s",
                      help="seconds per mode and load level (blocks go on until every mode had this long)")
    load.add_argument("--block", type=int, default=None,
                      help="requests per interleaved block (default: 2 × concurrency, or ~10 s of arrivals)")

    what = p.add_argument_group("what")
    what.add_argument("--modes", default="0,4,auto",
                      help="draft lengths compared, sent per request: auto and/or k values (default 0,4,auto)")
    what.add_argument("--workload", default="chat,grounded,code",
                      help="comma-separated: bundled sets (chat, grounded, code, all), sets built from public data "
                           "(humaneval, humaneval-edit, sharegpt-extract, sharegpt-chat, shared-system; pip install "
                           "'specdec[bench]') and/or .jsonl paths")
    what.add_argument("--turns", type=int, default=3,
                      help="sharegpt-chat: user turns per conversation, each a measured request (default 3); "
                           "--num-requests then counts conversations")
    what.add_argument("--system-words", type=int, default=None,
                      help="shared-system: words in the shared system prompt (default 500: about 1,000 tokens)")
    what.add_argument("--input-words", type=int, default=None, help="cut or pad every input to this many words")
    what.add_argument("--max-tokens", type=int, default=48, help="output tokens per request (default 48)")
    what.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    what.add_argument("--top-p", type=float, default=None)
    what.add_argument("--seed", type=int, default=0, help="seeds the prompt order, arrivals and sampling")
    what.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode first (default 1)")
    what.add_argument("--timeout", type=float, default=300.0, dest="timeout_s", help="per-request deadline, s")

    out = p.add_argument_group("output")
    out.add_argument("--slo", type=_slo, action="append", default=[],
                     help="an SLO for goodput, METRIC=SECONDS with METRIC ttft, tpot or e2el (repeatable; "
                          "e.g. --slo ttft=0.5 --slo tpot=50ms)")
    out.add_argument("--out", default=DEFAULT_OUT,
                     help="output prefix: writes PREFIX.json, PREFIX.md and PREFIX.png (default loadtest-report)")
    out.add_argument("--no-plot", action="store_true", help="skip the PNG")
    out.add_argument("--from-json", default=None, metavar="PATH",
                     help="run nothing: write the Markdown and PNG again from a result JSON (next to it, or --out)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

    chaos = p.add_argument_group("chaos")
    chaos.add_argument("--chaos-kill-draft-every", type=float, default=None, metavar="S",
                       help="with --start-pipeline: SIGKILL the draft service every S seconds of its uptime and "
                            "start it again; the report gives fallback rounds, errors and recovery time")
    chaos.add_argument("--chaos-kills", type=int, default=None, metavar="N",
                       help="stop after N kills, and run on past --num-requests/--duration until speculation "
                            "has resumed after the last one (at most 10 min)")


def add_loadtest_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdec loadtest` on the top-level subparsers."""
    p = sub.add_parser("loadtest", help="load-test the API, draft lengths side by side (JSON, Markdown, PNG)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_loadtest)


def config_from_args(args: argparse.Namespace):
    from loadtest.runner import Load, LoadTestConfig

    if args.rate:
        loads = [Load("rate", v) for v in args.rate]
    else:
        loads = [Load("concurrency", v) for v in (args.concurrency or [1])]
    return LoadTestConfig(
        modes=[m.strip() for m in args.modes.split(",") if m.strip()], loads=loads, num_requests=args.num_requests,
        duration_s=args.duration_s, block=args.block, arrival=args.arrival, burstiness=args.burstiness,
        ramp_s=args.ramp_s, workload=args.workload, input_words=args.input_words, turns=args.turns,
        system_words=args.system_words, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, slos=dict(args.slo), warmup=args.warmup,
        timeout_s=args.timeout_s)


def start_pipeline(args: argparse.Namespace, http: bool, echo=print):
    """The `specdec up` defaults on free ports (others may run a pipeline on the usual ones)."""
    require_serving("specdec loadtest --start-pipeline")
    from specdec.launcher import Pipeline, PipelineSpec, free_port
    from specdec.runtime.models import resolve_model_path

    plan = PipelineSpec(orchestrator_port=free_port(), draft_port=free_port(), target_port=free_port(),
                        redis_port=free_port(), http_port=free_port() if http else 0, proposer=args.proposer,
                        log_dir=args.log_dir or tempfile.mkdtemp(prefix="specdec-loadtest-logs-"))
    if args.target_model:
        plan.target_model = args.target_model
    if args.draft_model:
        plan.draft_model = args.draft_model
    plan.extra_target_args = shlex.split(args.target_args)
    for spec in {plan.target_model, plan.draft_model}:  # convert packaged models once, with a progress bar
        resolve_model_path(spec, progress=True)
    pipeline = Pipeline(plan)
    started = time.monotonic()
    pipeline.start(echo=echo)
    echo(f"pipeline up in {time.monotonic() - started:.0f}s (logs in {pipeline.log_dir})")
    return pipeline


def command_line(args: argparse.Namespace) -> str:
    """The run as one `specdec loadtest` command: every flag whose value is not the default."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = ["specdec", "loadtest"]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif action.dest == "slo":
            for name, limit in value:
                words += [flag, f"{name}={limit:g}"]
        elif isinstance(value, list):
            words += [flag, ",".join(f"{v:g}" for v in value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def cmd_loadtest(args: argparse.Namespace) -> int:
    from loadtest.chaos import DraftChaos
    from loadtest.clients import GrpcLoadClient, HttpLoadClient, ServerNotFound
    from loadtest.report import headline_table, write_reports
    from loadtest.runner import run_loadtest

    def echo(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.from_json:
        return rerender(args.from_json, args.out if args.out != DEFAULT_OUT else None, plots=not args.no_plot)

    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        echo(f"error: {exc}")
        return 2
    if args.target_args and not args.start_pipeline:
        echo("error: --target-args needs --start-pipeline (flags for a target service this load test starts)")
        return 2
    if args.chaos_kill_draft_every is not None:
        if not args.start_pipeline:
            echo("error: --chaos-kill-draft-every needs --start-pipeline (it kills and restarts the draft process "
                 "the load test started itself)")
            return 2
        if args.proposer == "none" or all(m == "0" for m in config.modes):
            echo("error: the chaos option needs a draft to kill and a mode that drafts (k > 0 or auto)")
            return 2
        if args.chaos_kill_draft_every <= 0 or (args.chaos_kills is not None and args.chaos_kills < 1):
            echo("error: --chaos-kill-draft-every must be positive and --chaos-kills at least 1")
            return 2
    pipeline = start_pipeline(args, http=args.api == "http", echo=echo) if args.start_pipeline else None
    try:
        if pipeline is not None:
            address, url = pipeline.plan.grpc_addresses()["orchestrator"], pipeline.plan.http_url()
        else:
            address, url = args.address, args.http_url
        chaos_factory = None
        if args.chaos_kill_draft_every is not None:
            def chaos_factory(clock):
                return DraftChaos(pipeline, args.chaos_kill_draft_every, clock, max_kills=args.chaos_kills, echo=echo)

        async def go():
            client = HttpLoadClient(url, args.timeout_s) if args.api == "http" else GrpcLoadClient(address,
                                                                                                   args.timeout_s)
            try:
                return await run_loadtest(config, client, chaos_factory=chaos_factory,
                                          progress=not args.no_progress, echo=echo)
            finally:
                await client.close()

        try:
            result = asyncio.run(go())
        except ServerNotFound as exc:
            echo(f"error: {exc}")
            return 2
        except ValueError as exc:
            echo(f"error: {exc}")
            return 2
    finally:
        if pipeline is not None:
            pipeline.stop()
    paths = write_reports(result, args.out, command=command_line(args), plots=not args.no_plot)
    print(headline_table(result))
    if result.get("chaos"):
        c = result["chaos"]
        print(f"chaos: {c['kills']} kills, {c['errors']} errors, {c['fallback_rounds']} fallback rounds, "
              f"recovery median {c['recovery_s']['median']} s")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def rerender(path: str, out: str | None, plots: bool = True) -> int:
    """The Markdown and PNG of an earlier run, from its JSON (the report code may have changed)."""
    import json
    from pathlib import Path

    from loadtest.report import write_reports

    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        print(f"error: cannot read a load-test result from {path}: {exc}", file=sys.stderr)
        return 2
    paths = write_reports(result, out or Path(path).with_suffix(""), command=result.get("command", ""), plots=plots)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(cmd_loadtest(parser.parse_args(argv)))
