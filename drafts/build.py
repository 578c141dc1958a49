"""`specdec draft build`: a shallow draft from the target's own layers, self-distilled in a budget.

Steps: load the target; get the training text (prompts it invents, or a given file, and its
answers with top-k log-probs; cached) and held-out reference text (the bundled prompts by
default, never trained on); pick the layers (evenly spaced by default: measured to distil
best, see docs/benchmarks.md); copy them; distil within the budget; save a normal transformers model
directory plus `draft-build.json`.

All of it runs on `--device` (auto: the first CUDA GPU if any, else the CPU): the target
generates there, the draft trains there. Checkpoints and the saved draft hold host tensors, so
the draft loads, and a stopped build resumes, on any device.
"""

from __future__ import annotations

import gc
import json
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drafts.data import TeacherData, cached_teacher_data, load_prompt_file
from drafts.distill import (
    DistillConfig,
    DistillResult,
    distill,
    evaluate,
    has_state,
)
from drafts.shallow import (
    LAYER_STRATEGIES,
    choose_layers,
    freeze_shared,
    make_shallow,
    parse_layers,
    parse_width,
    save_draft,
)
from specdec.data import bundled_prompts
from specdec.defaults import cache_dir
from specdec.runtime.models import load_model, resolve_device

REPORT_FILE = "draft-build.json"
STATE_DIR = "resume-state"


@dataclass
class BuildConfig:
    """Every field is a `specdec draft build` flag."""

    target: str
    layers: str  # a count ("4") or explicit indices ("0,1,2,29")
    out: str
    budget_min: float = 10.0  # training wall-clock minutes (data generation is extra, cached)
    width: str | None = None  # MLP width: absolute ("768") or fraction ("0.5"); default: the target's
    strategy: str = "even"  # which layers for a count: even, first, first-last
    prompts: str | None = None  # training prompt file; default: prompts the target invents
    invent: int = 256  # how many prompts the target invents when no file is given
    heldout: str | None = None  # held-out prompt file; default: the bundled prompt set
    max_new_tokens: int = 128  # answer length per training prompt
    heldout_tokens: int = 64  # reference continuation length per held-out prompt
    sampled_fraction: float = 0.25  # share of training answers sampled (T = 0.8) instead of greedy
    top_k: int = 32  # target log-probs kept per position
    lr: float = 2e-3
    tokens_per_batch: int = 512
    validation_sequences: int = 16  # training sequences held back to pick the best weights (0: none)
    head_sample: int = 4096  # sampled-softmax columns besides the teacher's tokens (0 = the full vocabulary)
    checkpoint_every_s: float = 120.0
    generation_batch_size: int = 8
    seed: int = 0
    threads: int | None = None
    device: str = "auto"  # where the target generates and the draft trains: auto, cpu, cuda or cuda:N
    cache: str | None = None  # where teacher data is cached (default: SPECDEC_CACHE/drafts)
    resume: bool = False
    progress: bool = True

    def validate(self) -> None:
        check_device("--device", self.device)
        if self.budget_min < 0:
            raise ValueError(f"--budget must be >= 0 minutes, got {self.budget_min}")
        if self.strategy not in LAYER_STRATEGIES:
            raise ValueError(f"--strategy must be one of {', '.join(LAYER_STRATEGIES)}")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError("--sampled-fraction must be within [0, 1]")
        if self.validation_sequences < 0:
            raise ValueError("--validation-sequences must be >= 0")
        for name in ("invent", "max_new_tokens", "heldout_tokens", "top_k", "tokens_per_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def check_device(flag: str, name: str) -> torch.device:
    """`resolve_device`, its ValueError naming the flag (a GPU this machine lacks fails before any work)."""
    try:
        return resolve_device(name)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _say(config: BuildConfig, message: str) -> None:
    if config.progress:
        print(f"specdec draft build: {message}", flush=True)


def split_validation(data: TeacherData, count: int, seed: int) -> tuple[TeacherData, TeacherData | None]:
    """Hold `count` sequences (chosen by seed) out of training, to pick the best weights by."""
    if count <= 0 or len(data) < 2 * count:
        return data, None
    held = set(random.Random(seed).sample(range(len(data)), count))
    return (data.subset([i for i in range(len(data)) if i not in held]),
            data.subset(sorted(held)))


def _prompts(config: BuildConfig) -> tuple[list[dict] | None, list[dict]]:
    train = load_prompt_file(config.prompts) if config.prompts else None
    heldout = load_prompt_file(config.heldout) if config.heldout else bundled_prompts()
    return train, heldout


def build_draft(config: BuildConfig) -> dict:
    """Build the draft described by `config` into `config.out`; return (and write) the report."""
    config.validate()
    started = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out).expanduser()
    state_dir = out / STATE_DIR
    resuming = config.resume and has_state(state_dir)
    target = load_model(config.target, dtype="float32", threads=config.threads, progress=config.progress,
                        device=config.device)
    _say(config, f"generating and training on {target.describe_device()}")
    n_layers = target.model.config.num_hidden_layers
    count, explicit = parse_layers(config.layers, n_layers)
    width = parse_width(config.width, target.model.config.intermediate_size)

    cache = Path(config.cache).expanduser() if config.cache else cache_dir() / "drafts"
    train_prompts, heldout_prompts = _prompts(config)
    data_started = time.perf_counter()
    train, train_cached = cached_teacher_data(
        cache, target, prompts=train_prompts, invent=config.invent, max_new_tokens=config.max_new_tokens,
        top_k=config.top_k, sampled_fraction=config.sampled_fraction, seed=config.seed, exclude=heldout_prompts,
        batch_size=config.generation_batch_size, progress=config.progress, kind="train")
    heldout, _ = cached_teacher_data(
        cache, target, prompts=heldout_prompts, invent=0, max_new_tokens=config.heldout_tokens, top_k=config.top_k,
        sampled_fraction=0.0, seed=0, batch_size=1, progress=config.progress, kind="heldout")
    data_s = time.perf_counter() - data_started
    _say(config, f"training text: {len(train)} sequences, {train.teacher_positions} target positions "
                 f"({'cached' if train_cached else f'generated in {data_s:.0f}s'}); held-out: {len(heldout)} prompts, "
                 f"{heldout.teacher_positions} positions")

    saved_build = state_dir / "build.json"
    if resuming and saved_build.is_file():
        layers = json.loads(saved_build.read_text())["layers"]
        strategy = "resumed"
    elif explicit is not None:
        layers, strategy = explicit, "explicit"
    else:
        strategy = config.strategy
        layers = choose_layers(n_layers, count, strategy)

    draft = make_shallow(target.model, layers, width)  # on the target's device
    target_config, target_params = target.model.config, sum(p.numel() for p in target.model.parameters())
    target.model = None  # the draft holds copies of what it needs: free the device for training
    if target.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    trainable = freeze_shared(draft)
    before = evaluate(draft, heldout)
    _say(config, f"draft: layers {layers} of {n_layers}, held-out KL {before['kl']:.3f}, "
                 f"agreement {before['agreement']:.3f}; distilling for {config.budget_min:g} min")
    if not resuming and state_dir.exists():
        shutil.rmtree(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    saved_build.write_text(json.dumps({"layers": layers, "width": width, "target": config.target}))
    budget_s = config.budget_min * 60.0
    fit, validation = split_validation(train, config.validation_sequences, config.seed)
    result = DistillResult()
    if budget_s > 0:
        result = distill(draft, fit, DistillConfig(budget_s=budget_s, lr=config.lr, seed=config.seed,
                                                     tokens_per_batch=config.tokens_per_batch,
                                                     head_sample=config.head_sample,
                                                     checkpoint_every_s=config.checkpoint_every_s),
                         state_dir=state_dir, resume=resuming, progress=config.progress, validation=validation)
    after = evaluate(draft, heldout)
    save_draft(draft, target.tokenizer, out)
    check = load_model(str(out), dtype="float32", progress=False, device="cpu")  # the saved files, on the host
    loadable = check.fingerprint == target.fingerprint and check.model.config.num_hidden_layers == len(layers)
    del check

    n_params = sum(p.numel() for p in draft.parameters())  # tied weights counted once
    report = {
        "target": config.target,
        "target_layers": n_layers,
        "layers": layers,
        "depth": len(layers),
        "strategy": strategy,
        "width": width or target_config.intermediate_size,
        "tied_embeddings": bool(getattr(target_config, "tie_word_embeddings", False)),
        "frozen": ["embeddings", "output layer"],
        "parameters": {"total": n_params,
                       "trainable": sum(p.numel() for n, p in draft.named_parameters() if n in set(trainable)),
                       "target_total": target_params},
        "data": {"train_sequences": len(fit), "train_tokens": fit.total_tokens,
                 "train_positions": fit.teacher_positions, "train_prompts": "file" if config.prompts else "invented",
                 "train_cached": train_cached, "train_generation_s": train.meta.get("seconds"),
                 "train_generated_on": train.meta.get("device"),
                 "heldout_prompts": [p.get("id") for p in heldout.prompts],
                 "heldout_positions": heldout.teacher_positions, "top_k": config.top_k},
        "training": {"budget_s": budget_s, "seconds": round(result.seconds, 1), "steps": result.steps,
                     "tokens": result.tokens, "positions": result.positions, "epochs": result.epochs,
                     "tokens_per_s": round(result.tokens / result.seconds, 1) if result.seconds else None,
                     "resumed_from_step": result.resumed_from_step,
                     "validation_sequences": len(validation) if validation is not None else 0,
                     "validation_seconds": result.validation_seconds, "best_step": result.best_step,
                     "validation_curve": result.validation,
                     "loss_first": result.losses[0][2] if result.losses else None,
                     "loss_last": result.losses[-1][2] if result.losses else None,
                     "loss_curve": result.losses},
        "heldout": {"before": before, "after": after,
                    "note": "agreement = the draft's argmax equals the target's greedy token, per position of "
                            "the target's own greedy continuation of held-out prompts (the per-token acceptance "
                            "α of greedy speculative decoding)"},
        "loadable": loadable,
        "config": asdict(config),
        "machine": {"device": target.describe_device(), "threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__},
        "seconds_total": round(time.perf_counter() - started, 1),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    _say(config, f"saved {out}: held-out KL {before['kl']:.3f} → {after['kl']:.3f}, agreement "
                 f"{before['agreement']:.3f} → {after['agreement']:.3f} after {result.steps} steps")
    return report
