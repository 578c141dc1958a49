"""Every Redis connection specdec makes, built one way: `RedisSettings`, then `connect`.

A service names where its Redis is (one server by URL, a Redis Cluster by some of its nodes, or
the master that Redis Sentinels name), and how to reach it: a password (from a file or
`$REDIS_PASSWORD`, never from argv, where `ps` and pod specs show it), TLS with a CA and an
optional client certificate, and timeouts for connecting and for each call, so that a Redis that
stops answering fails a call instead of hanging the thread that made it. The runtime's stores
(`specdec.runtime.snapshot_store`, `prefix_store`) take the client `connect` returns; they never
build one themselves.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Address = tuple[str, int]

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_TIMEOUT_S = 10.0


def read_password(password_file: str = "") -> str | None:
    """The Redis password: the file's content (stripped) when a file is named, else `$REDIS_PASSWORD`
    when set, else None. A password inside a URL still wins over both (redis-py's rule)."""
    if password_file:
        try:
            return Path(password_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--redis-password-file {password_file}: {exc.strerror or exc}") from exc
    return os.environ.get("REDIS_PASSWORD") or None


@dataclass(frozen=True)
class RedisSettings:
    """Where one Redis deployment is and how to reach it (see the module docstring).

    One mode: `url` (one server; `rediss://` for TLS), `cluster_nodes` (seeds of a Redis Cluster)
    or `sentinels` with `sentinel_master`. `tls`: TLS to the cluster nodes, or to the sentinels and
    their master. `tls_ca`, `tls_cert`, `tls_key`: PEM files (the CA the server's certificate must
    chain to; a client certificate for servers that ask for one). Timeouts in seconds.
    """

    url: str = ""
    cluster_nodes: tuple[Address, ...] = ()
    sentinels: tuple[Address, ...] = ()
    sentinel_master: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    password: str | None = field(default=None, repr=False)
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        modes = [name for name, on in (("a URL", self.url), ("cluster nodes", self.cluster_nodes),
                                       ("sentinels", self.sentinels)) if on]
        if len(modes) != 1:
            raise ValueError("a Redis is named by a URL, cluster nodes or sentinels, exactly one; "
                             f"got {modes or 'none'}")
        if bool(self.sentinels) != bool(self.sentinel_master):
            raise ValueError("--redis-sentinels and --redis-sentinel-master go together")
        if self.tls and self.mode == "single":
            raise ValueError("a single Redis takes TLS from its URL: use rediss://")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--redis-tls-cert and --redis-tls-key go together")
        if (self.tls_ca or self.tls_cert) and not self.uses_tls:
            flag = "--redis-tls-ca" if self.tls_ca else "--redis-tls-cert"
            raise ValueError(f"{flag} needs TLS: a rediss:// URL (or --redis-tls with cluster nodes or sentinels)")
        if self.connect_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("Redis timeouts must be positive")

    @classmethod
    def from_url(cls, url: str, password_file: str = "", **options: Any) -> RedisSettings:
        """One Redis by URL, its password read as `read_password` reads it."""
        return cls(url=url, password=read_password(password_file), **options)

    @property
    def mode(self) -> Literal["single", "cluster", "sentinel"]:
        return "cluster" if self.cluster_nodes else "sentinel" if self.sentinels else "single"

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.url.startswith("rediss://")

    @property
    def where(self) -> str:
        """The deployment as log lines name it: never a password."""
        if self.cluster_nodes:
            return "redis cluster at " + _addresses(self.cluster_nodes)
        if self.sentinels:
            return f"redis master {self.sentinel_master!r} of sentinels " + _addresses(self.sentinels)
        return "redis at " + re.sub(r"//[^/@]*@", "//", self.url)

    def options(self) -> dict[str, Any]:
        """redis-py's keyword arguments for these settings (password, TLS files, timeouts)."""
        options: dict[str, Any] = {"socket_connect_timeout": self.connect_timeout_s,
                                   "socket_timeout": self.timeout_s}
        if self.password is not None:
            options["password"] = self.password
        if self.tls:  # a single Redis: the rediss:// scheme says it
            options["ssl"] = True
        for name, value in (("ssl_ca_certs", self.tls_ca), ("ssl_certfile", self.tls_cert),
                            ("ssl_keyfile", self.tls_key)):
            if value:
                options[name] = value
        return options

    def sentinel_options(self) -> dict[str, Any]:
        """What the connections to the sentinels themselves take: TLS and timeouts (the password is
        the master's)."""
        return {k: v for k, v in self.options().items() if k != "password"}


def _addresses(addresses: Sequence[Address]) -> str:
    return ",".join(f"{host}:{port}" for host, port in addresses)


def connect(settings: RedisSettings, *, asyncio: bool = False) -> Any:
    """A client of the deployment `settings` name: `redis.Redis` (or `redis.asyncio.Redis` with
    `asyncio`), a `RedisCluster`, or the master client of a `Sentinel`. Connects lazily: the first
    call does."""
    if asyncio:
        import redis.asyncio as lib
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.sentinel import Sentinel
    else:
        import redis as lib  # type: ignore[no-redef]
        from redis.cluster import ClusterNode, RedisCluster  # type: ignore[assignment]
        from redis.sentinel import Sentinel  # type: ignore[assignment]

    options = settings.options()
    if settings.cluster_nodes:
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in settings.cluster_nodes],
                            **options)
    if settings.sentinels:
        sentinel = Sentinel(list(settings.sentinels), sentinel_kwargs=settings.sentinel_options(), **options)
        return sentinel.master_for(settings.sentinel_master)
    return lib.Redis.from_url(settings.url, **options)
