"""The proposers a draft service can run (`--proposer NAME`), and what it builds them with.

Each entry of `PROPOSERS` builds one `Proposer` from the service's config and a `DraftHost` (the
draft model, loaded on first use with its batcher; the tokenizer). Everything else the service
does (streaming, grammars, Release, what GetInfo reports) goes through the `Proposer` interface,
so a new draft source is a class, its entry in `draft_service.config.PROPOSER_OPTIONS` (its name
and the options it reads) and a builder here:

    @register("mine")
    def _mine(config, host):
        return MyProposer.batched(host.batcher())
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draft_service.config import PROPOSER_OPTIONS, DraftConfig
from specdec.runtime.batching import Batcher
from specdec.runtime.drafting import Proposer
from specdec.runtime.grammars import SessionGrammars
from specdec.runtime.info import model_info
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import LoadedModel, load_tokenizer, tokenizer_fingerprint
from specdec.runtime.proposers import HybridProposer, ModelProposer, NgramProposer, SuffixProposer
from specdec.server.model_service import admission_and_metrics, batcher_for, load_on, model_thread
from specdec.v1 import common_pb2


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


Build = Callable[[DraftConfig, DraftHost], Proposer]


PROPOSERS: dict[str, Build] = {}
"""A builder for each `--proposer` choice (`draft_service.config.PROPOSER_OPTIONS` says what each reads)."""


def register(name: str) -> Callable[[Build], Build]:
    """Add the decorated builder to `PROPOSERS` as `--proposer name` (a choice the config lists)."""
    if name not in PROPOSER_OPTIONS:
        raise ValueError(f"--proposer {name} is not a choice of DraftConfig (add it to PROPOSER_OPTIONS)")

    def add(build: Build) -> Build:
        PROPOSERS[name] = build
        return build

    return add


def build_proposer(config: DraftConfig, host: DraftHost) -> Proposer:
    """The configured proposer."""
    return PROPOSERS[config.proposer](config, host)


def suffix_proposer(config: DraftConfig) -> SuffixProposer:
    """Suffix speculation as configured (alone, or beside the model of a hybrid draft)."""
    return SuffixProposer(config.suffix_max_depth, config.suffix_min_match, config.suffix_min_prob,
                          config.suffix_max_tokens, config.max_sessions,
                          learn_on_release=not config.suffix_redis_url, max_groups=config.suffix_max_groups,
                          spec_factor=config.suffix_spec_factor)


@register("suffix")
def _suffix(config: DraftConfig, host: DraftHost) -> Proposer:
    return suffix_proposer(config)


@register("ngram")
def _ngram(config: DraftConfig, host: DraftHost) -> Proposer:
    return NgramProposer(config.ngram_max, config.ngram_min)


@register("model")
def _model(config: DraftConfig, host: DraftHost) -> Proposer:
    return ModelProposer.batched(host.batcher(), host.profile)


@register("hybrid")
def _hybrid(config: DraftConfig, host: DraftHost) -> Proposer:
    return HybridProposer(ModelProposer.batched(host.batcher(), host.profile), suffix_proposer(config))
