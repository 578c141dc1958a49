from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from specdec.defaults import DEFAULT_MODEL, MAX_DECODE_STEPS
from specdec.server.config import RedisClientOptions, ServiceConfig
from specdec.server.redis import RedisSettings


class OrchestratorConfig(RedisClientOptions, ServiceConfig):
    """specdec orchestrator: runs speculative decoding sessions over the draft and target services."""

    port: int = Field(50051, ge=0, le=65535, description="Port of the public gRPC API (0 picks a free one).")
    target: str = Field(
        "127.0.0.1:50053",
        description="Target replicas: HOST:PORT[,HOST:PORT...], dns:///NAME:PORT (every address it resolves to) or "
        "kubernetes:///[NAMESPACE/]SERVICE:PORT (the Service's EndpointSlices, watched; see docs/discovery.md).",
    )
    draft: str = Field(
        "127.0.0.1:50052",
        description="Draft replicas, written as for --target; empty runs plain decoding only.",
    )
    replica_refresh_s: float = Field(
        5.0, gt=0, description="Seconds between re-resolving and probing the replicas (a kubernetes:/// change "
        "applies at once)."
    )
    backend_tls_ca: str = Field(
        "", description="PEM CA that draft and target certificates must chain to; set: TLS to them."
    )
    backend_tls_cert: str = Field("", description="PEM client certificate presented to draft and target (mutual TLS).")
    backend_tls_key: str = Field("", description="PEM private key of --backend-tls-cert.")
    backend_tls_server_name: str = Field(
        "", description="Name expected in the draft/target certificates when it differs from the address (e.g. an IP)."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6390/0",
        description="Redis URL of the session store; rediss:// for TLS. Keep the password out of it (argv is visible).",
    )
    redis_cluster_nodes: str = Field(
        "", description="Instead of --redis-url, a Redis Cluster: HOST:PORT[,HOST:PORT...] of some of its nodes "
        "(the rest is discovered)."
    )
    redis_sentinels: str = Field(
        "", description="Instead of --redis-url, Redis Sentinels: HOST:PORT[,HOST:PORT...]; they name the master of "
        "--redis-sentinel-master and follow its failovers."
    )
    redis_sentinel_master: str = Field("", description="Name of the master the --redis-sentinels monitor.")
    redis_tls: bool = Field(
        False, description="TLS to the cluster nodes, or to the sentinels and their master (a single Redis: rediss://)."
    )
    redis_failover_s: float = Field(
        30.0, gt=0, description="With --redis-cluster-nodes or --redis-sentinels: how long a session-store call "
        "retries (backoff up to 1 s) while a replica is promoted; a single --redis-url is not retried."
    )
    model: str = Field(
        DEFAULT_MODEL, description="Tokenizer to use (must match the target's): model name or directory."
    )
    draft_length: int | Literal["auto"] = Field(
        "auto",
        description="Default draft length: 'auto' (chosen per round from measured costs) or a fixed k "
        "(0 = plain decoding).",
    )
    max_draft_length: int = Field(
        16, ge=0, le=64, description="Largest k a request may ask for, and the bound of 'auto'."
    )
    overlap: bool = Field(
        False,
        description="Draft the next block while the target verifies this one (pays when draft and target do "
        "not share compute).",
    )
    save_behind: bool = Field(
        True,
        description="Send a round's calls while the previous round's session save runs (that round is still "
        "streamed only once saved).",
    )
    verify_ahead: bool = Field(
        True,
        description="Tell the target when a round's next round will draft nothing (k = 0, or the draft's followers "
        "of the block say so), so that a target with nothing else to run verifies it while the answer travels "
        "(VerifyRequest.continues, VerifyRequest.followers).",
    )
    decode_steps: int = Field(
        4, ge=1, le=MAX_DECODE_STEPS,
        description="Rounds at k = 0 (plain decoding, but for a generation's first round) ask the target for up to "
        "this many tokens in one call (VerifyRequest.decode_steps): the same tokens as one round each, their passes "
        "run back to back, the round's work around them (the calls, the session save, the chunk) done once. The "
        "client then gets them as one chunk; 1: a round a token.",
    )
    verify_stream: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Send each round's verify over a long-lived VerifyStream call to the target (saves a call's "
        "setup a round) or, off, as a Verify call a round, each with its own span and request id in the target. "
        "auto: on, unless this orchestrator exports traces.",
    )
    propose_stream: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Send each round's Propose over a long-lived ProposeStream call to the draft (saves a call's "
        "setup a round; the block comes in one message) or, off, as a Propose call a round, each with its own span "
        "and request id in the draft. auto: on, unless this orchestrator exports traces.",
    )
    policy_explore_every: int = Field(16, ge=2, description="'auto' tries a neighbouring k every this many rounds.")
    policy_ewma: float = Field(0.2, gt=0, le=1, description="Weight of a new measurement in the controller's averages.")
    default_max_new_tokens: int | None = Field(
        None, ge=1, description="max_new_tokens when a request leaves it unset; unset: --max-new-tokens-limit "
        "(the generation also ends when the model's context is full, as OpenAI's API does).")
    max_new_tokens_limit: int = Field(4096, ge=1, description="Largest max_new_tokens a request may ask for.")
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings per request.")
    max_stop_length: int = Field(256, ge=1, description="Longest stop string, in characters.")
    max_stop_token_ids: int = Field(256, ge=0, description="Most stop_token_ids per request.")
    max_logit_bias: int = Field(
        1024, ge=0, description="Most logit_bias entries per request (it is kept with the session and sent to each "
        "draft and target replica once)."
    )
    max_grammar_bytes: int = Field(
        64 * 1024, ge=1, le=256 * 1024, description="Largest grammar (JSON schema, regex, Lark or GBNF text) a "
        "request may send, in bytes (at most 256 KiB: what draft and target accept). Grammars are also bounded in "
        "nesting (100 levels), in the grammar engine's work, and to 10 s of compiling; past any bound, "
        "INVALID_ARGUMENT naming it. The grammar is kept with the session and sent to each draft and target "
        "replica once."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Most tokens a request's input may have (unset: what the model's context holds)."
    )
    max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request message the public API accepts, in bytes."
    )
    max_concurrent_per_token: int = Field(
        16, ge=0, description="Generations one token may run at once on this replica (0 = no limit; not applied "
        "without --auth-tokens-file/env)."
    )
    max_closes_per_s: float = Field(
        10.0, ge=0, description="CloseSession calls one token (without tokens: one client address) may make per "
        "second on this replica, in bursts of up to twice as many; each sends a Release to every replica "
        "(RESOURCE_EXHAUSTED with a retry hint beyond; 0 = no limit)."
    )
    status_cache_s: float = Field(
        1.0, ge=0, description="Seconds GetStatus reuses a replica's last GetInfo answer (concurrent callers share "
        "one call), so GetStatus never fans out to every replica more often; 0 asks on every call."
    )
    auth_tokens_file: str = Field(
        "", description="File of accepted bearer tokens, one per line: TOKEN or NAME:TOKEN. With none (here or in "
        "--auth-tokens-env) the API is open."
    )
    auth_tokens_env: str = Field(
        "SPECDEC_AUTH_TOKENS", description="Environment variable with more tokens (same format, lines or commas)."
    )
    session_ttl_s: int = Field(3600, ge=1, description="Seconds a session is kept in Redis after its last use.")
    session_lease_s: float = Field(
        60.0, gt=0, description="A running generation holds its session this long past its latest round; "
        "other requests on the session get ABORTED meanwhile (a resume takes the generation over at once)."
    )
    draft_timeout_s: float = Field(
        10.0, gt=0, description="Deadline of one draft call; past it the round runs at k = 0."
    )
    draft_retry_s: float = Field(
        2.0, gt=0, description="After a draft failure, seconds before that replica is tried again."
    )
    target_retry_s: float = Field(
        5.0, gt=0, description="After a target replica fails, seconds before it is tried again."
    )
    target_timeout_s: float = Field(
        120.0, gt=0, description="Time limit of one verify call (includes a re-prefill). A call past it is not a "
        "failure by itself: if the replica still answers it is busy, and the call is sent to it again with twice the "
        "limit; only a replica that does not answer is marked down (the request's own deadline still bounds it all).")
    kv_snapshots: bool = Field(
        False, description="After each generation, have the target and draft replicas holding the session write "
        "its KV caches to Redis in the background (the services need --snapshot-redis-url; a prompt-lookup draft "
        "has none to write), so another replica can restore them instead of re-prefilling."
    )
    share_outputs: bool = Field(
        True, description="Append each finished generation's output tokens to a capped Redis stream that draft "
        "replicas running --proposer suffix read, so a pattern one session produced speeds up the next on any "
        "replica; written only while a draft replica reports reading it (nothing is stored behind other drafts; "
        "named explicitly with a draft that keeps no corpus, or none, it is refused at start). An output drafts "
        "only requests of its own corpus group (--corpus-groups; by default each caller identity is a group of "
        "its own, and without tokens all callers are one). Within a group sharing reveals outputs: every chunk's "
        "round statistics show what the draft proposed and what was accepted, so a caller probing with greedy "
        "decoding and a logit_bias can read the group's earlier outputs token by token, and timing shows whether "
        "a text was generated recently. Output stays lossless either way; turn it off where callers of one group "
        "must not learn each other's outputs."
    )
    corpus_groups: str = Field(
        "", description="Identities whose outputs may draft each other's requests (see --share-outputs): "
        "'GROUP=NAME,NAME;GROUP=NAME', names as --auth-tokens-file gives them (token-<12 hex> for an unnamed "
        "token), '*' for every identity named nowhere else. Empty: each identity is its own group. Group only "
        "callers that may read each other's outputs."
    )
    max_concurrent: int = Field(
        256, ge=1, description="Admission: generations running at once; more wait in the queue."
    )
    max_queued: int = Field(
        256, ge=0, description="Admission: generations waiting for a slot; beyond this RESOURCE_EXHAUSTED at once."
    )

    @field_validator("corpus_groups")
    @classmethod
    def _corpus_groups(cls, value: str) -> str:
        from orchestrator.corpus import CorpusGroups

        CorpusGroups.parse(value)  # ValueError names what is wrong
        return value

    @field_validator("redis_cluster_nodes", "redis_sentinels")
    @classmethod
    def _host_ports(cls, value: str) -> str:
        if value and not all(_HOST_PORT.fullmatch(a.strip()) for a in value.split(",")):
            raise ValueError("expected HOST:PORT[,HOST:PORT...]")
        return value

    @model_validator(mode="after")
    def _one_redis_mode(self):
        """One Redis mode: --redis-url (the default), --redis-cluster-nodes or --redis-sentinels."""
        modes = [flag for flag, on in (("--redis-url", "redis_url" in self.model_fields_set),
                                       ("--redis-cluster-nodes", bool(self.redis_cluster_nodes)),
                                       ("--redis-sentinels", bool(self.redis_sentinels))) if on]
        if len(modes) > 1:
            raise ValueError(f"{' and '.join(modes)} are different Redis modes: give only one")
        if bool(self.redis_sentinels) != bool(self.redis_sentinel_master):
            raise ValueError("--redis-sentinels and --redis-sentinel-master go together")
        if self.redis_tls and self.redis_mode == "single":
            raise ValueError("--redis-tls is for --redis-cluster-nodes or --redis-sentinels; a single Redis "
                             "uses a rediss:// --redis-url")
        if "redis_failover_s" in self.model_fields_set and self.redis_mode == "single":
            raise ValueError("--redis-failover-s is for --redis-cluster-nodes or --redis-sentinels: a single Redis "
                             "has no replica to wait for, and its calls are not retried")
        return self

    @property
    def redis_mode(self) -> Literal["single", "cluster", "sentinel"]:
        return "cluster" if self.redis_cluster_nodes else "sentinel" if self.redis_sentinels else "single"

    def session_redis(self) -> RedisSettings:
        """The session store's Redis, in the configured mode, with --redis-tls and the password, TLS
        files and timeouts (`RedisClientOptions`); ValueError when they do not fit together."""
        if self.redis_mode == "cluster":
            return self.redis_settings(cluster_nodes=tuple(self.redis_addresses), tls=self.redis_tls)
        if self.redis_mode == "sentinel":
            return self.redis_settings(sentinels=tuple(self.redis_addresses),
                                       sentinel_master=self.redis_sentinel_master, tls=self.redis_tls)
        return self.redis_settings(self.redis_url)

    @property
    def redis_addresses(self) -> list[tuple[str, int]]:
        """The cluster seeds or the sentinels, as (host, port)."""
        listed = self.redis_cluster_nodes or self.redis_sentinels
        pairs = [a.strip().rsplit(":", 1) for a in listed.split(",")] if listed else []
        return [(host, int(port)) for host, port in pairs]


_HOST_PORT = re.compile(r"[^\s:,]+:\d{1,5}")
