"""`specdec` command: start the pipeline locally, generate text, stop it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields

from specdec.errors import SpecdecError, Unavailable


def _add_plan_flags(parser: argparse.ArgumentParser) -> None:
    from specdec.launcher import Plan

    helps = {
        "target_model": "target model: packaged default name, local directory or transformers id",
        "target_dtype": "target weight dtype", "target_threads": "torch threads of the target process",
        "draft_model": "draft model (for --proposer model); its tokenizer must match the target's",
        "draft_dtype": "draft weight dtype", "draft_threads": "torch threads of the draft process",
        "proposer": "draft source: model, ngram (prompt lookup) or none (plain decoding)",
        "draft_length": "default draft length: auto (the controller picks k per round) or a fixed k (0 = plain decoding)",
        "ngram_min": "shortest suffix n-gram prompt lookup matches", "ngram_max": "longest suffix n-gram it matches",
        "host": "interface every service binds", "log_dir": "where the service logs go",
    }
    for f in fields(Plan):
        if f.name not in helps and not f.name.endswith("_port"):
            continue
        kind = int if f.type in ("int", "int | None") else str
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                            help=f"{helps.get(f.name, f.name.replace('_', ' '))} (default: {f.default!r})")


def cmd_up(args: argparse.Namespace) -> int:
    from specdec.launcher import Pipeline, Plan, state_file
    from specdec.runtime.models import resolve_model_path

    plan = Plan(**{f.name: getattr(args, f.name) for f in fields(Plan) if hasattr(args, f.name)})
    if state_file().exists() and args.detach:
        print(f"a detached pipeline may already be running ({state_file()}); run `specdec down` first",
              file=sys.stderr)
        return 1
    # Convert packaged models once, here, with a progress bar, before the services load them.
    for spec in {plan.target_model, plan.draft_model}:
        resolve_model_path(spec, progress=True)
    pipeline = Pipeline(plan)
    started = time.monotonic()
    pipeline.start(echo=print)
    print(f"pipeline up in {time.monotonic() - started:.1f}s: orchestrator at "
          f"{plan.host}:{plan.orchestrator_port}")
    if args.detach:
        pipeline.save()
        print("stop it with: specdec down")
        return 0
    print("press Ctrl-C to stop")
    try:
        while all(p.poll() is None for p in pipeline.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in pipeline.procs.items() if p.poll() is not None]
        print(f"process exited: {', '.join(dead)}; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        pipeline.stop()


def cmd_down(args: argparse.Namespace) -> int:
    from specdec.launcher import state_file, stop_pids

    path = state_file()
    if not path.exists():
        print("no detached pipeline is running (nothing to stop)")
        return 0
    state = json.loads(path.read_text())
    stop_pids(state["pids"])
    path.unlink()
    print("pipeline stopped")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.client import Client

    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop or (), draft_length=args.draft_length,
                  session_id=args.session or "")
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    text, tokens, stats, session_id, finish = [], [], {}, "", None
    try:
        with Client(args.address, timeout=args.timeout) as client:
            for chunk in client.stream(prompt, **kwargs):
                session_id = chunk.session_id
                tokens.extend(chunk.token_ids)
                text.append(chunk.text)
                if not args.json:
                    print(chunk.text, end="", flush=True)
                if chunk.stats is not None:
                    stats, finish = chunk.stats, chunk.finish_reason
    except Unavailable as exc:
        print(f"\nerror: cannot reach the orchestrator at {args.address} ({exc}).\n"
              "Start the pipeline with `specdec up` (or `specdec up --detach`), or pass --address.",
              file=sys.stderr)
        return 2
    except SpecdecError as exc:
        print(f"\nerror ({exc.code.name}): {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"session_id": session_id, "text": "".join(text), "token_ids": tokens,
                          "finish_reason": finish, "stats": stats}))
    else:
        print()
        print(f"[{stats.get('completion_tokens', 0)} tokens in {stats.get('elapsed_s', 0):.2f}s, "
              f"{stats.get('tokens_per_second', 0):.1f} tok/s, acceptance {stats.get('acceptance_rate', 0):.2f}, "
              f"mean accepted length {stats.get('mean_accepted_length', 0):.2f}, finish {finish}]",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, draft, target and orchestrator locally")
    _add_plan_flags(up)
    up.add_argument("--detach", action="store_true", help="return once healthy; stop later with `specdec down`")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop a pipeline started with `specdec up --detach`")
    down.set_defaults(func=cmd_down)

    gen = sub.add_parser("generate", help="generate text, streaming it to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051", help="orchestrator address")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--draft-length", default=None,
                     help="k for this request: auto, or a number (0 = plain decoding); default: the server's")
    gen.add_argument("--session", default=None, help="continue this session id")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
