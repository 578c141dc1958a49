"""The proposers a draft service can run (`--proposer NAME`), and what it builds them with.

Each entry of `PROPOSERS` builds one `Proposer` from the service's config and a `DraftHost` (the
draft model, loaded on first use with its batcher; the tokenizer). Everything else the service
does (streaming, grammars, Release, what GetInfo reports) goes through the `Proposer` interface,
so a new draft source is a class and an entry here:

    @register("mine", "what it is, in a few words", runs_model=True)
    def _mine(config, host):
        return MyProposer.batched(host.batcher())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.runtime.batching import Batcher
from specdec.runtime.drafting import Proposer
from specdec.runtime.grammars import SessionGrammars
from specdec.runtime.info import model_info
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import LoadedModel, load_tokenizer, tokenizer_fingerprint
from specdec.runtime.proposers import HybridProposer, ModelProposer, NgramProposer, SuffixProposer
from specdec.server.model_service import admission_and_metrics, batcher_for, load_on, model_thread
from specdec.v1 import common_pb2

if TYPE_CHECKING:
    from draft_service.config import DraftConfig


class DraftHost:
    """What a proposer is built with. The draft model is loaded on the first `batcher()` call, on the
    one thread that then runs all its passes (`model_thread`); a proposer that never asks loads none.
    Build it inside the event loop (the batcher's)."""

    def __init__(self, config: DraftConfig) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.thread = model_thread("draft")  # a thread starts at its first task: never, for a draft without a model
        self.profile = LatencyProfile(per_token_s=config.emulate_draft_per_token_ms / 1e3)
        self.admission, self.metrics = admission_and_metrics(config, "draft")
        self.loaded: LoadedModel | None = None
        self._batcher: Batcher | None = None

    def batcher(self) -> Batcher:
        """The batcher running the draft model (loaded now if it is not yet)."""
        if self._batcher is None:
            loaded, caches = load_on(self.thread, self.config, "draft")
            self.loaded = loaded
            self._batcher = batcher_for(self.config, caches, self.profile, self.admission, self.metrics, self.thread)
        return self._batcher

    @property
    def batcher_if_loaded(self) -> Batcher | None:
        return self._batcher

    def info(self, kind: str, proposer: Proposer) -> tuple[common_pb2.ModelInfo, SessionGrammars]:
        """What GetInfo reports (the model if one was loaded, else the tokenizer's), and the grammars
        of the sessions, built on the same tokenizer."""
        config, loaded = self.config, self.loaded
        if loaded is not None:
            info = model_info(loaded, kind, self.profile, config.max_batch)
            grammars = SessionGrammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, config.max_sessions)
        else:
            tokenizer = load_tokenizer(config.model)
            info = common_pb2.ModelInfo(model=config.model, dtype="none", kind=kind, device="cpu",
                                        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                        vocab_size=len(tokenizer))
            grammars = SessionGrammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], config.max_sessions)
        info.draft_sources.extend(proposer.sources)
        info.learns_outputs = proposer.learns_outputs
        return info, grammars


Build = Callable[["DraftConfig", DraftHost], Proposer]


@dataclass(frozen=True)
class Registered:
    """A proposer the service can run: how to build it, and which options it takes."""

    build: Build
    summary: str  # a few words for messages, e.g. "suffix speculation alone"
    runs_model: bool = False  # loads the draft model: takes its engine and --snapshot-* options
    option_groups: tuple[str, ...] = ()  # the --GROUP-* options it reads, e.g. ("suffix",)


PROPOSERS: dict[str, Registered] = {}
OPTION_GROUPS = {"ngram": "prompt lookup", "suffix": "suffix speculation"}  # --GROUP-* options: what they configure


def register(name: str, summary: str, runs_model: bool = False,
             option_groups: tuple[str, ...] = ()) -> Callable[[Build], Build]:
    """Add the decorated builder to `PROPOSERS` as `--proposer name`."""

    def add(build: Build) -> Build:
        PROPOSERS[name] = Registered(build, summary, runs_model, option_groups)
        return build

    return add


def runs(option_group: str = "", model: bool = False) -> list[str]:
    """The names of the proposers that read the --`option_group`-* options (or that run the model)."""
    return [name for name, entry in PROPOSERS.items()
            if (model and entry.runs_model) or (option_group and option_group in entry.option_groups)]


def build_proposer(config: DraftConfig, host: DraftHost) -> Proposer:
    """The configured proposer."""
    return PROPOSERS[config.proposer].build(config, host)


def suffix_proposer(config: DraftConfig) -> SuffixProposer:
    """Suffix speculation as configured (alone, or beside the model of a hybrid draft)."""
    return SuffixProposer(config.suffix_max_depth, config.suffix_min_match, config.suffix_min_prob,
                          config.suffix_max_tokens, config.max_sessions,
                          learn_on_release=not config.suffix_redis_url)


@register("suffix", "suffix speculation alone", option_groups=("suffix",))
def _suffix(config: DraftConfig, host: DraftHost) -> Proposer:
    return suffix_proposer(config)


@register("ngram", "prompt lookup", option_groups=("ngram",))
def _ngram(config: DraftConfig, host: DraftHost) -> Proposer:
    return NgramProposer(config.ngram_max, config.ngram_min)


@register("model", "a draft model alone", runs_model=True)
def _model(config: DraftConfig, host: DraftHost) -> Proposer:
    return ModelProposer.batched(host.batcher(), host.profile)


@register("hybrid", "a draft model with suffix speculation", runs_model=True, option_groups=("suffix",))
def _hybrid(config: DraftConfig, host: DraftHost) -> Proposer:
    return HybridProposer(ModelProposer.batched(host.batcher(), host.profile), suffix_proposer(config))
