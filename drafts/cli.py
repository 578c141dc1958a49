"""`specdec draft build` and `specdec draft profile`: flags mapped onto BuildConfig / ProfileConfig."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.defaults import DEFAULT_MODEL
from specdec.extras import require_serving
from specdec.runtime.engine_options import QUANTIZE_GROUP

HELDOUT_SETS = ("bundled", "sharegpt-chat", "humaneval")  # drafts.profile.HELDOUT_SETS (that module loads torch)

DEVICE_HELP = "auto (the first CUDA GPU if any, else the CPU), cpu, cuda or cuda:N:"


def cmd_build(args: argparse.Namespace) -> int:
    require_serving("specdec draft build")
    from drafts.build import BuildConfig, build_draft

    config = BuildConfig(
        target=args.target, layers=args.layers, out=args.out, budget_min=args.budget, width=args.width,
        strategy=args.strategy, prompts=args.prompts, invent=args.invent, heldout=args.heldout,
        max_new_tokens=args.max_new_tokens, heldout_tokens=args.heldout_tokens,
        sampled_fraction=args.sampled_fraction, top_k=args.top_k, lr=args.lr, tokens_per_batch=args.tokens_per_batch,
        head_sample=args.head_sample, validation_sequences=args.validation_sequences,
        checkpoint_every_s=args.checkpoint_every, seed=args.seed, threads=args.threads, device=args.device,
        cache=args.cache, resume=args.resume, progress=not args.quiet)
    try:
        report = build_draft(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: report[k] for k in ("layers", "strategy", "heldout")}
    summary["training"] = {k: v for k, v in report["training"].items() if k != "loss_curve"}
    print(json.dumps(summary, indent=2))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    require_serving("specdec draft profile")
    from drafts.profile import ProfileConfig, profile_drafts

    config = ProfileConfig(
        target=args.target, drafts=args.draft or [], copy=not args.no_copy, ngram=args.ngram,
        copy_quantize=_listed(args.copy_quantize), copy_quantize_group=args.copy_quantize_group, suffix=args.suffix,
        hybrid=args.hybrid, draft_dtype=args.draft_dtype, target_dtype=args.target_dtype,
        target_weights=args.target_weights, k=args.k, heldout=args.heldout, heldout_set=args.heldout_set,
        heldout_count=args.heldout_count, heldout_tokens=args.heldout_tokens, latency_steps=args.latency_steps,
        latency_rounds=args.latency_rounds, threads=args.threads, device=args.device,
        target_device=args.target_device, draft_device=args.draft_device,
        e2e=not args.no_e2e, e2e_tokens=args.e2e_tokens, e2e_prompts=args.e2e_prompts, repeats=args.repeats,
        target_threads=args.target_threads, draft_threads=args.draft_threads, target_cpus=args.target_cpus,
        draft_cpus=args.draft_cpus, overlap=args.overlap, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        out=args.out, plot=args.plot, cache=args.cache, progress=not args.quiet)
    try:
        result = profile_drafts(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for cand in result["candidates"]:
        e2e = cand.get("e2e")
        speed = (f"  ×{e2e[str(args.k)]['speedup']:.2f} (k={args.k})  ×{e2e['auto']['speedup']:.2f} (auto)"
                 if e2e else "")
        print(f"{cand['name']:>22}  step {cand['step_ms']:7.2f} ms ({cand['latency_ratio']:.3f}×)  "
              f"α {cand['agreement']:.3f}  acc@k {cand['acceptance']['acceptance_rate']:.3f}{speed}")
    return 0


def _listed(value: str) -> list[str]:
    """"int4,int8" -> ["int4", "int8"] ("" -> [])."""
    return [v.strip() for v in value.split(",") if v.strip()]


def add_draft_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdec draft {build,profile}` on the top-level subparsers."""
    draft = sub.add_parser("draft", help="build a shallow self-distilled draft from a target, or profile drafts")
    verbs = draft.add_subparsers(dest="draft_command", required=True)

    build = verbs.add_parser("build", help="cut a shallow draft from the target's layers and distil it on the "
                                           "target's own text within a time budget")
    build.add_argument("--target", default=DEFAULT_MODEL, help="target model spec (default: %(default)s)")
    build.add_argument("--layers", required=True,
                       help="draft depth (e.g. 4) or explicit target layer indices (0,1,2,29)")
    build.add_argument("--width", default=None, help="MLP width of the draft: units (768) or a fraction (0.5); "
                                                     "default: the target's")
    build.add_argument("--budget", type=float, required=True, help="training wall-clock minutes (data generation "
                                                                   "is extra and cached across builds)")
    build.add_argument("--out", required=True, help="output model directory")
    build.add_argument("--prompts", default=None, help="training prompts (JSONL with messages/prompt, or one per "
                                                       "line); default: prompts the target invents itself")
    build.add_argument("--invent", type=int, default=256, help="prompts the target invents when --prompts is not "
                                                               "given (default: %(default)s)")
    build.add_argument("--heldout", default=None, help="held-out prompts, never trained on (default: the bundled set)")
    build.add_argument("--strategy", default="even", choices=["even", "first", "first-last"],
                       help="which target layers for a depth: evenly spaced from first to last (default; distils "
                            "best here), the first ones, or the first ones plus the last")
    build.add_argument("--max-new-tokens", type=int, default=128, help="target answer length per prompt")
    build.add_argument("--heldout-tokens", type=int, default=64, help="target tokens per held-out prompt")
    build.add_argument("--sampled-fraction", type=float, default=0.25, help="share of answers sampled at T=0.8")
    build.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position (default: 32)")
    build.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: %(default)s)")
    build.add_argument("--tokens-per-batch", type=int, default=512,
                       help="tokens per optimizer step (default: %(default)s)")
    build.add_argument("--head-sample", type=int, default=4096,
                       help="train the output layer's softmax on the teacher's top-k tokens plus this many sampled "
                            "others (0 = the full vocabulary; default: %(default)s)")
    build.add_argument("--validation-sequences", type=int, default=16,
                       help="training sequences held back; the draft ends with the weights of the lowest KL on "
                            "them (0: none, the last weights; default: %(default)s)")
    build.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds between resume checkpoints")
    build.add_argument("--resume", action="store_true", help="continue a stopped build in --out (same budget total)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    build.add_argument("--device", default="auto", help=DEVICE_HELP + " where the target writes the training text "
                                                         "and the draft trains (default: %(default)s)")
    build.add_argument("--cache", default=None, help="teacher-data cache folder (default: SPECDEC_CACHE/drafts)")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.set_defaults(func=cmd_build)

    prof = verbs.add_parser("profile", help="step latency, held-out acceptance and end-to-end speedup of drafts")
    prof.add_argument("--target", default=DEFAULT_MODEL, help="target model spec (default: %(default)s)")
    prof.add_argument("--draft", action="append", help="a draft model directory (repeatable)")
    prof.add_argument("--ngram", action="store_true", help="also profile prompt lookup")
    prof.add_argument("--suffix", action="store_true",
                      help="also profile suffix speculation (its corpus: the target's answers to the earlier "
                           "held-out prompts)")
    prof.add_argument("--no-copy", action="store_true", help="skip the target's own copy in --draft-dtype")
    prof.add_argument("--copy-quantize", default="", metavar="int4,int8",
                      help="also profile the target's copy quantized so, loaded as the draft service's --quantize "
                           "loads it (float32 activations, on the CPU)")
    prof.add_argument("--copy-quantize-group", type=int, default=QUANTIZE_GROUP,
                      help="weights per group of --copy-quantize, a multiple of 32 (default: %(default)s; int4 at 32 "
                           "is q4_1: the packaged GGUF's own grouping)")
    prof.add_argument("--hybrid", default="", choices=["", "int4", "int8"],
                      help="also profile the hybrid of suffix speculation and the copy quantized so (one of "
                           "--copy-quantize)")
    prof.add_argument("--draft-dtype", default="bfloat16")
    prof.add_argument("--target-dtype", default="float32")
    prof.add_argument("--target-weights", default="auto", choices=["auto", "gguf", "dense"],
                      help="the target's --weights: gguf (a GGUF's blocks as stored), dense (float weights; a GGUF "
                           "de-quantized to float32: the full-precision stand-in) or auto (default)")
    prof.add_argument("--k", type=int, default=4, help="fixed draft length (default: 4)")
    prof.add_argument("--heldout", default=None, help="held-out prompt file (default: --heldout-set)")
    prof.add_argument("--heldout-set", default="bundled", choices=list(HELDOUT_SETS),
                      help="held-out prompts without a file: the bundled set (default), ShareGPT's first human "
                           "turns (sharegpt-chat: open-ended chat) or HumanEval (the bench extra)")
    prof.add_argument("--heldout-count", type=int, default=16, help="prompts taken from --heldout-set's public data")
    prof.add_argument("--heldout-tokens", type=int, default=64)
    prof.add_argument("--latency-steps", type=int, default=24, help="decode steps timed per round")
    prof.add_argument("--latency-rounds", type=int, default=3,
                      help="rounds in which every model is timed in turn (median; default: %(default)s)")
    prof.add_argument("--threads", type=int, default=None, help="torch threads for the in-process measurements")
    prof.add_argument("--device", default="auto",
                      help=DEVICE_HELP + " where the target and the drafts run, in process and in the end-to-end "
                                         "pipelines (default: %(default)s)")
    prof.add_argument("--target-device", default=None, help="the target's device, if not --device")
    prof.add_argument("--draft-device", default=None, help="the drafts' device, if not --device")
    prof.add_argument("--no-e2e", action="store_true", help="skip the end-to-end pipeline runs")
    prof.add_argument("--e2e-tokens", type=int, default=48)
    prof.add_argument("--e2e-prompts", type=int, default=8)
    prof.add_argument("--repeats", type=int, default=1)
    prof.add_argument("--target-threads", type=int, default=None)
    prof.add_argument("--draft-threads", type=int, default=None)
    prof.add_argument("--target-cpus", default="", help="taskset cores for the target process, e.g. 0")
    prof.add_argument("--draft-cpus", default="", help="taskset cores for the draft process, e.g. 1")
    prof.add_argument("--overlap", action="store_true", help="orchestrator --overlap")
    prof.add_argument("--ngram-min", type=int, default=2)
    prof.add_argument("--ngram-max", type=int, default=3)
    prof.add_argument("--out", default="drafts-profile.json", help="JSON output (the plot goes next to it)")
    prof.add_argument("--plot", default=None, help="PNG output (default: --out with .png)")
    prof.add_argument("--cache", default=None)
    prof.add_argument("--quiet", action="store_true")
    prof.set_defaults(func=cmd_profile)
