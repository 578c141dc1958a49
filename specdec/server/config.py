"""One typed, validated config object per service; command-line flags are mapped onto it."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec.runtime.engine_options import LINEAR_MAX_ROWS, QUANTIZE_GROUP, EngineOptions
from specdec.server.redis import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S, RedisSettings, read_password

C = TypeVar("C", bound="ServiceConfig")


class ServiceConfig(BaseModel):
    """Base: every field becomes a `--flag` (underscores as dashes), its description the help."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 for all interfaces).")
    port: int = Field(0, ge=0, le=65535, description="Port to listen on (0 picks a free one).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="Port of the Prometheus endpoint (http://host:port/metrics); unset = off, 0 = a free port "
                    "(logged).",
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text (for people) or one JSON object each (for collectors); both carry "
        "request, session and trace ids.",
    )
    tls_cert: str = Field("", description="PEM certificate (chain) this server presents; with --tls-key it serves TLS.")
    tls_key: str = Field("", description="PEM private key of --tls-cert.")
    tls_ca: str = Field(
        "", description="PEM CA bundle client certificates must chain to (with --tls-client-auth required)."
    )
    tls_client_auth: Literal["none", "required"] = Field(
        "none", description="'required': mutual TLS, only clients with a certificate signed by --tls-ca get in "
        "(draft and target behind the orchestrator).",
    )
    otel_endpoint: str = Field(
        "", description="OTLP/gRPC collector to export traces to (e.g. http://otel-collector:4317); empty: only the "
        "standard OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_ENDPOINT variables, or no export.",
    )
    otel_file: str = Field("", description="Also write every finished span as one JSON line to this file (debugging).")

    @field_validator("tls_cert", "tls_key", "tls_ca")
    @classmethod
    def _readable(cls, path: str) -> str:
        if path and not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
        return path

    @model_validator(mode="after")
    def _tls_consistent(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_auth == "required" and not (self.tls_cert and self.tls_ca):
            raise ValueError("--tls-client-auth required needs --tls-cert, --tls-key and --tls-ca")
        if self.tls_ca and self.tls_client_auth != "required":
            raise ValueError("--tls-ca checks client certificates: add --tls-client-auth required")
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls: type[C], argv: Sequence[str] | None = None, prog: str | None = None) -> C:
        parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
        for name, field in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            help_text = f"{field.description or ''} (default: {field.default!r})"
            if field.annotation is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else None
                parser.add_argument(flag, default=None, choices=choices, help=help_text)
        args = vars(parser.parse_args(argv))
        try:
            return cls(**{k: v for k, v in args.items() if v is not None})
        except ValidationError as exc:
            parser.error(_explain(exc))
            raise  # unreachable: parser.error exits


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        if not err["loc"]:  # a check across fields: its message names the flags
            lines.append(str(err["msg"]).removeprefix("Value error, "))
            continue
        flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
        message = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{flag}: {message} (got {err.get('input')!r})")
    return "; ".join(lines)


class RedisClientOptions(BaseModel):
    """How a service reaches its Redis, wherever that is: the password, TLS files and timeouts every
    Redis connection of the service uses (`specdec.server.redis`)."""

    redis_password_file: str = Field(
        "", description="File holding the Redis password; unset: $REDIS_PASSWORD when set, else none."
    )
    redis_tls_ca: str = Field("", description="PEM CA that the Redis server certificate must chain to (rediss://).")
    redis_tls_cert: str = Field("", description="PEM client certificate for Redis (when it requires one).")
    redis_tls_key: str = Field("", description="PEM private key of --redis-tls-cert.")
    redis_connect_timeout_s: float = Field(
        DEFAULT_CONNECT_TIMEOUT_S, gt=0, description="Seconds to wait for a connection to Redis before the call fails."
    )
    redis_timeout_s: float = Field(
        DEFAULT_TIMEOUT_S, gt=0, description="Seconds to wait for Redis to answer one call before it fails (a Redis "
        "that stops answering fails calls instead of hanging them)."
    )

    @field_validator("redis_password_file", "redis_tls_ca", "redis_tls_cert", "redis_tls_key")
    @classmethod
    def _redis_file_readable(cls, path: str) -> str:
        if path and not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
        return path

    def redis_settings(self, url: str = "", **mode) -> RedisSettings:
        """The settings of the Redis at `url` (or of the cluster or sentinels `mode` names) with this
        service's password, TLS files and timeouts; ValueError when they do not fit together."""
        return RedisSettings(url=url, password=read_password(self.redis_password_file), tls_ca=self.redis_tls_ca,
                             tls_cert=self.redis_tls_cert, tls_key=self.redis_tls_key,
                             connect_timeout_s=self.redis_connect_timeout_s, timeout_s=self.redis_timeout_s, **mode)


class DeviceOption(BaseModel):
    """The `--device` of a service that hosts a model (draft, target)."""

    device: str = Field(
        "auto",
        description="Where the model runs: auto (the first CUDA GPU if any, else the CPU), cpu, cuda or cuda:N.",
    )

    @field_validator("device")
    @classmethod
    def _device_exists(cls, device: str) -> str:
        from specdec.runtime.models import resolve_device  # torch only for services that host a model

        resolve_device(device)  # a GPU asked for on a machine without one fails at start, not at load
        return device


Dtype = Literal["auto", "float32", "bfloat16", "float16", "float64"]
MaxBatch = Annotated[int, Field(ge=1, le=256)]
BatchWindowMs = Annotated[float, Field(ge=0, le=1000)]


KV_OPTIONS = ("kv_cache_bytes", "prefix_cache", "prefix_block_tokens", "prefix_redis_url", "prefix_min_fetch_tokens",
              "prefix_ttl_s", "prefill_chunk_tokens", "prepack_weights", "compile", "kernels", "native_linear_rows",
              "weights", "quantize", "quantize_group")
"""Options of a service's model engine (its KV caches and forward pass): meaningless without a model."""


class ModelServiceConfig(RedisClientOptions, ServiceConfig, DeviceOption):
    """Base of the services that host a model (draft, target): its KV caches and their snapshots in
    Redis (reached with the --redis-* password, TLS and timeout options), batching and admission.
    The fields without a default here get theirs, and their help, from each service; their types and
    bounds are checked here."""

    snapshot_redis_url: str = Field(
        "", description="Redis URL of the KV snapshot store (empty: no snapshots); may be the session store's Redis."
    )
    snapshot_min_tokens: int = Field(
        256, ge=1, description="Snapshots are saved and restored only for contexts at least this long "
        "(below it a re-prefill is about as cheap: see bench/snapshot.py)."
    )
    snapshot_ttl_s: int = Field(3600, ge=1, description="Seconds a snapshot is kept in Redis.")
    model: str
    dtype: Dtype
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice).")
    max_sessions: int = Field(256, ge=1, description="KV caches kept at most (least recently used evicted first).")
    idle_ttl_s: float = Field(900.0, gt=0, description="Seconds an unused session cache is kept.")
    kv_cache_bytes: int = Field(
        0, ge=0, description="Bytes of keys/values held at most, sessions' and shared prefixes' (0: derived from the "
        "machine: on a CPU half the memory available at start, or of the container's memory limit (cgroup v1 or v2) "
        "less what it holds when that is smaller; 0.9 of the GPU memory free after loading). When full, "
        "unused prefixes and idle sessions are evicted (least recently used first), else RESOURCE_EXHAUSTED."
    )
    prefix_cache: bool = Field(
        True, description="Share the keys/values of common prompt prefixes between sessions (blocks of "
        "--prefix-block-tokens, content-addressed)."
    )
    prefix_block_tokens: int = Field(32, ge=1, le=4096, description="Tokens per shared prefix block.")
    prepack_weights: Literal["auto", "on", "off"] = Field(
        "auto", description="Pre-pack the model's projection weights for oneDNN, fused per layer (auto: where that "
        "path exists: float32 on a CPU, or bfloat16 on a CPU with AVX512-BF16 or AMX; measured faster here for decode "
        "and verify passes, see bench/engine.py); "
        "costs a second copy of the weights in memory."
    )
    compile: Literal["auto", "on", "off"] = Field(
        "off", description="Run the dense part of every layer (norms, projections, rotary embedding, MLP) through "
        "torch.compile, compiled at service start (its time is logged) for every pass shape, so no request pays a "
        "compile (auto: where it can run, a C++ compiler on a CPU or CUDA; see bench/engine.py for what it gains)."
    )
    kernels: Literal["auto", "native", "torch"] = Field(
        "auto", description="The engine's C kernels: native (attention of all of a pass's rows in one call per "
        "layer, prefill chunks in pieces, each key/value read once for its grouped query heads; in float32 "
        "also the projections of passes of a few rows (--native-linear-rows), each weight read once for all rows; on "
        "all threads; built "
        "on first use with the machine's C compiler, or taken from $SPECDEC_PREBUILT_KERNELS), torch (torch's "
        "operators: attention row by row, projections through oneDNN/MKL), auto (native where they build and run: a "
        "CPU, float32/float64/bfloat16, bfloat16 summed in float32; see bench/engine.py)."
    )
    native_linear_rows: Literal["auto"] | Annotated[int, Field(ge=0, le=LINEAR_MAX_ROWS)] = Field(
        "auto", description="The most rows of a pass (decode and verify positions over all its sessions) whose "
        "projections run through the native linear kernel (float32, with the native kernels); larger passes use "
        "oneDNN's pre-packed weights. auto: measured at start on the model's own weights, as the most rows up to "
        "which the kernel is at least as fast (it won up to 48 where oneDNN runs AVX2 code, up to 8 and ties beyond "
        "where it runs AVX-512), and logged. Up to this many rows a session's logits are the same bits whatever "
        "shares its pass: 48 makes decode and verify passes of up to 48 rows batch-invariant; 0 uses oneDNN only. "
        "A count above 0 where the kernel does not run (no C compiler or prebuilt kernels, a GPU) stops the service "
        "at start."
    )
    weights: Literal["auto", "gguf", "dense"] = Field(
        "auto", description="Which weights are served: gguf (a GGUF file's quantized blocks, the packaged default's "
        "q4_1 / q8_0, run as stored by the native kernels with float32 activations: the bytes the model ships in, "
        "the same weights as its float32 copy), dense (float weights in --dtype; a GGUF de-quantized once into a "
        "cached float32 checkpoint), auto (gguf where the model is a GGUF, --dtype float32 or auto, on a CPU with "
        "the native kernels and no --quantize; else dense). GetInfo reports what is served (format and fingerprint)."
    )
    quantize: Literal["none", "int8", "int4"] = Field(
        "none", description="Weight-only quantization of the model's linear layers at load, run by the native "
        "kernels (float32 activations and sums): int4 (a scale and a minimum per group, 4 bits a weight), int8 (a "
        "scale per group); none. The quantized model is its own reference: a target serves its outputs, a draft "
        "proposes for a full-precision target (lossless either way). A CPU only; --dtype defaults to float32."
    )
    quantize_group: int = Field(
        QUANTIZE_GROUP, ge=32, description="Weights per --quantize group, a multiple of 32 (int4 at 32 stores q4_1, "
        "int8 at 32 q8_0; larger groups: fewer bytes, more error)."
    )
    prefill_chunk_tokens: int = Field(
        512, ge=0, description="Most prompt tokens one forward pass prefills, over all its sessions (0: no limit); a "
        "longer prompt is prefilled over several passes, each shared with the running sessions' steps, so its "
        "arrival delays them by a bounded amount. A prompt scored for its log-probabilities (echo, prompt_logprobs) "
        "goes the same way, at most 512 positions a pass whatever the limit."
    )
    prefix_redis_url: str = Field(
        "", description="Redis URL through which replicas share prefix blocks (empty: each replica keeps its own): "
        "blocks a replica computes are written there, and a replica missing a prefix fetches it instead of "
        "prefilling it. May be the session store's Redis."
    )
    prefix_min_fetch_tokens: int = Field(
        256, ge=1, description="A prefix is fetched from Redis only when that saves prefilling at least this many "
        "tokens (below it a prefill is about as cheap: see bench/snapshot.py)."
    )
    prefix_ttl_s: int = Field(3600, ge=1, description="Seconds a shared prefix block is kept in Redis.")

    @model_validator(mode="after")
    def _prefix_options_need_their_feature(self):
        def given(*names: str) -> str:
            return ", ".join("--" + n.replace("_", "-") for n in names if n in self.model_fields_set)

        if self.prefix_redis_url and not self.prefix_cache:
            raise ValueError("--prefix-redis-url shares the prefix cache's blocks: drop --no-prefix-cache")
        if not self.prefix_cache and given("prefix_block_tokens"):
            raise ValueError("--prefix-block-tokens sizes the prefix cache's blocks: drop --no-prefix-cache")
        if not self.prefix_redis_url and given("prefix_min_fetch_tokens", "prefix_ttl_s"):
            raise ValueError(f"{given('prefix_min_fetch_tokens', 'prefix_ttl_s')} configure sharing prefixes "
                             "through Redis: add --prefix-redis-url URL")
        return self

    @model_validator(mode="before")
    @classmethod
    def _quantized_weights_run_float32(cls, data):
        """With quantized weights (--quantize, --weights gguf) an unset --dtype means float32, the
        activations the kernels take, whatever the service's default (a draft's is bfloat16)."""
        if isinstance(data, dict) and "dtype" not in data and (
                data.get("quantize", "none") != "none" or data.get("weights") == "gguf"):
            data = {**data, "dtype": "float32"}
        return data

    @model_validator(mode="after")
    def _engine_options_hold_together(self):
        """Refused at start, with the flags named: what `EngineOptions` refuses, and what a model of
        --dtype could not honour."""
        from specdec.runtime.models import resolve_device, resolve_dtype

        options = self.engine_options
        device = resolve_device(self.device)
        options.check_dtype(resolve_dtype(self.dtype, device))
        if "quantize_group" in self.model_fields_set and self.quantize == "none":
            raise ValueError("--quantize-group sizes the groups of --quantize: add --quantize int4 or int8")
        if options.quantized and device.type != "cpu":
            raise ValueError(f"{options.quantized} runs in the CPU kernels, not on --device {self.device} "
                             f"({device}): pass --device cpu")
        return self

    @property
    def engine_options(self) -> EngineOptions:
        """The engine's options (`--prepack-weights`, `--compile`, `--kernels`, `--native-linear-rows`,
        `--weights`, `--quantize`, `--quantize-group`), as the model loader, the KV caches and the
        forward pass take them: each `EngineOptions` field from the config
        field named after its flag."""
        return EngineOptions(**{name: getattr(self, flag.removeprefix("--").replace("-", "_"))
                                for name, flag in EngineOptions.FLAGS.items()})
    max_batch: MaxBatch
    batch_window_ms: BatchWindowMs
    max_concurrent: int = Field(64, ge=1, description="Admission: requests served at once; more wait in the queue.")
    health_stall_s: float = Field(
        60.0, gt=0, description="Health reports NOT_SERVING while work has waited this many seconds on the model "
        "thread with no forward pass completing (a stalled model thread then fails Kubernetes' probes instead of "
        "answering SERVING); SERVING again once a pass completes. Above the longest pass: a prefill chunk of "
        "--prefill-chunk-tokens at the longest context."
    )
    max_queued: int = Field(
        256, ge=0, description="Admission: requests that may wait; beyond, RESOURCE_EXHAUSTED with a retry hint."
    )
