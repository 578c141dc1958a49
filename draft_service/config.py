from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from specdec.defaults import DEFAULT_MODEL
from specdec.server.config import KV_OPTIONS, BatchWindowMs, Dtype, MaxBatch, ModelServiceConfig


@dataclass(frozen=True)
class ProposerOptions:
    """What a proposer takes from the config (`draft_service.registry` builds it)."""

    summary: str  # a few words for messages, e.g. "suffix speculation alone"
    runs_model: bool = False  # loads the draft model: takes its engine and --snapshot-* options
    option_groups: tuple[str, ...] = ()  # the --GROUP-* options it reads, e.g. ("suffix",)


PROPOSER_OPTIONS: dict[str, ProposerOptions] = {
    "suffix": ProposerOptions("suffix speculation alone", option_groups=("suffix",)),
    "ngram": ProposerOptions("prompt lookup", option_groups=("ngram",)),
    "model": ProposerOptions("a draft model alone", runs_model=True),
    "hybrid": ProposerOptions("a draft model with suffix speculation", runs_model=True, option_groups=("suffix",)),
}
"""Every `--proposer` choice and the options it reads; `draft_service.registry` holds one builder for each."""
OPTION_GROUPS = {"ngram": "prompt lookup", "suffix": "suffix speculation"}  # --GROUP-* options: what they configure


def runs(option_group: str = "", model: bool = False) -> list[str]:
    """The names of the proposers that read the --`option_group`-* options (or that run the model)."""
    return [name for name, entry in PROPOSER_OPTIONS.items()
            if (model and entry.runs_model) or (option_group and option_group in entry.option_groups)]


class DraftConfig(ModelServiceConfig):
    """specdec draft service: streams draft-token proposals for the orchestrator.

    The --snapshot-* options keep the model proposer's KV caches in Redis under the draft's own
    keys; prompt lookup and suffix speculation have no KV cache, so they refuse them. `--proposer
    hybrid` runs the model and suffix speculation side by side: each call takes the suffix proposal
    when it is confident and the model's otherwise (it takes the --suffix-* and the model's options).
    """

    port: int = Field(50052, ge=0, le=65535, description="Port to listen on (0 picks a free one).")
    # The keys of PROPOSER_OPTIONS (the chart's schema lists them too).
    proposer: Literal["model", "ngram", "suffix", "hybrid"] = Field(
        "suffix", description="Draft source: suffix speculation ('suffix', no model: the session's history and "
        "earlier outputs; the measured default on CPU), prompt lookup ('ngram', no model: the session's history "
        "alone), a causal LM ('model') or both ('hybrid': suffix speculation when it is confident, the model "
        "otherwise)."
    )
    model: str = Field(
        DEFAULT_MODEL, description="Draft model: the packaged default name, a local directory or a transformers id."
    )
    dtype: Dtype = Field("bfloat16", description="Weight dtype of the draft model.")
    max_batch: MaxBatch = Field(
        16, description="Most requests drafted (model proposer) in one forward pass (1 = no batching)."
    )
    batch_window_ms: BatchWindowMs = Field(
        5.0,
        description="Longest wait for the sessions of the previous forward pass to send their next request (the "
                    "pass starts at once when they are back or max-batch requests wait; the wait adapts to their "
                    "measured turnaround, up to this).",
    )
    emulate_draft_per_token_ms: float = Field(
        0.0, ge=0, description="BENCHMARK SIMULATION: pad each draft step to this many ms (0 = off)."
    )
    ngram_max: int = Field(3, ge=1, description="Longest suffix n-gram prompt lookup matches.")
    ngram_min: int = Field(2, ge=1, description="Shortest suffix n-gram prompt lookup matches.")
    suffix_max_depth: int = Field(
        32, ge=1, le=256, description="Suffix speculation: longest match of the history's end looked for."
    )
    suffix_min_match: int = Field(
        2, ge=1, description="Suffix speculation: shortest match that may propose anything."
    )
    suffix_min_prob: float = Field(
        0.1, gt=0, le=1, description="Suffix speculation: a proposal goes on while the product of its tokens' "
        "empirical probabilities stays at least this (higher: shorter, surer drafts)."
    )
    suffix_spec_factor: float = Field(
        1.0, ge=0, le=64, description="Suffix speculation: a proposal is at most this many times as long as the "
        "match it comes from (0: no such bound; a short match is weak evidence however few its occurrences)."
    )
    suffix_max_tokens: int = Field(
        1_000_000, ge=1, description="Suffix speculation: most tokens of earlier outputs indexed, over all corpus "
        "groups (and of each session's history); a group's oldest outputs are dropped first, and past the "
        "budget the least recently used group's whole corpus."
    )
    suffix_max_groups: int = Field(
        1024, ge=1, description="Suffix speculation: most corpus groups whose earlier outputs are kept (an output "
        "drafts only requests of its own group: each caller identity, or a group the orchestrator's "
        "--corpus-groups names); past it, the least recently used group's corpus goes."
    )
    suffix_redis_url: str = Field(
        "", description="Suffix speculation: Redis whose stream of finished outputs (specdec:v1:suffix:outputs) "
        "feeds the corpus, shared by every draft replica (a password not in the URL comes from $REDIS_PASSWORD); "
        "empty: each session's output joins this replica's corpus when the session is released."
    )
    suffix_backlog: int = Field(
        1000, ge=0, description="Suffix speculation: newest entries of the outputs stream read at start (0: only "
        "those added later)."
    )

    @model_validator(mode="after")
    def _options_of_the_proposer(self):
        """Each option is refused with a proposer that does not read it, naming those that do."""
        entry = PROPOSER_OPTIONS[self.proposer]
        models = " or ".join(runs(model=True))
        if not entry.runs_model and self.snapshot_redis_url:
            raise ValueError(f"--snapshot-redis-url needs --proposer {models}: {self.proposer} keeps no KV cache to "
                             "snapshot")
        engine_options = [name for name in KV_OPTIONS if name in self.model_fields_set]
        if engine_options and not entry.runs_model:
            flags = ", ".join("--" + name.replace("_", "-") for name in engine_options)
            raise ValueError(f"{flags} configure a draft model's KV caches and forward pass: --proposer "
                             f"{self.proposer} runs no model (use --proposer {models})")
        for group, what in OPTION_GROUPS.items():
            options = sorted(name for name in self.model_fields_set if name.startswith(group + "_"))
            if options and group not in entry.option_groups:
                flags = ", ".join("--" + name.replace("_", "-") for name in options)
                users = " or ".join(f"--proposer {name} ({PROPOSER_OPTIONS[name].summary})" for name in runs(group))
                raise ValueError(f"{flags} configure {what}, which --proposer {self.proposer} does not run: use "
                                 f"{users}")
        if self.suffix_min_match > self.suffix_max_depth:
            raise ValueError("--suffix-min-match must be <= --suffix-max-depth")
        return self
