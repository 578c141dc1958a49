"""Where a role's replicas are: a fixed list, a DNS name, or a Service's EndpointSlices.

A backend spec is one of
  `HOST:PORT[,HOST:PORT...]`              fixed addresses;
  `dns:///NAME:PORT`                      every address NAME resolves to (a headless Service);
  `kubernetes:///[NAMESPACE/]SERVICE:PORT` the endpoints of the Service, read from the Kubernetes API.

Each is a *source*: `await source.endpoints()` is the current list of `Endpoint`s (address,
readiness, node, zone) and `await source.wait(s)` returns after `s` seconds or as soon as the
list changed. The replica pool (replicas.py) consumes nothing else.

The Kubernetes source lists the `discovery.k8s.io/v1` EndpointSlices labelled
`kubernetes.io/service-name=SERVICE`, then watches them from the list's resourceVersion. A 410
Gone (an expired resourceVersion, as an HTTP status or an ERROR event) relists at once; any other
failure relists after a backoff. While the API cannot be listed, the source resolves
`SERVICE.NAMESPACE.svc:PORT` instead, and returns to the API as soon as a list succeeds. The
`kubernetes` client is synchronous, so the watch runs in a daemon thread that hands each new list
to the event loop with `call_soon_threadsafe`; the protocol itself (slices to endpoints, events
applied to a set of slices) is pure functions, tested without a server.

PORT is the port the pods serve on (the Service's targetPort); the fallback DNS name is called on
the same port, so keep the Service's port equal to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

log = logging.getLogger("specdec.orchestrator")

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
API_ENV = "SPECDEC_KUBERNETES_API"  # http(s) URL of an API server used without credentials (kubectl proxy, tests)
NODE_ENV, ZONE_ENV = "SPECDEC_NODE_NAME", "SPECDEC_ZONE"
SAME_NODE, SAME_ZONE, ELSEWHERE = 0, 1, 2
# Placement multiplies a replica's expected cost by the weight of its distance (each round of a
# session is two calls, so a hop across zones is paid per token): a new session goes to its own
# node unless that replica costs more than twice one in its zone, or four times one elsewhere.
LOCALITY_WEIGHT = {SAME_NODE: 1.0, SAME_ZONE: 2.0, ELSEWHERE: 4.0}


@dataclass(frozen=True)
class Endpoint:
    """One replica as discovery sees it. `ready`: it may be given sessions."""

    address: str  # host:port, IPv6 in brackets
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node: str = ""
    zone: str = ""


# -- specs ---------------------------------------------------------------------------------


def parse_addresses(spec: str) -> tuple[list[str], str | None]:
    """Static addresses, or the `name:port` of a `dns:///` name to resolve."""
    spec = spec.strip()
    if spec.startswith("dns:"):
        target = urlsplit(spec).path.lstrip("/")  # dns:///name:port or dns://authority/name:port
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{spec!r}: write a DNS name as dns:///NAME:PORT")
        return [], target
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{a!r}: write each replica as HOST:PORT")
    return addresses, None


@dataclass(frozen=True)
class ServiceRef:
    """`kubernetes:///[NAMESPACE/]SERVICE:PORT`."""

    namespace: str
    service: str
    port: int

    @property
    def label_selector(self) -> str:
        return f"kubernetes.io/service-name={self.service}"

    @property
    def dns_name(self) -> str:
        return f"{self.service}.{self.namespace}.svc:{self.port}"


def own_namespace() -> str:
    """The pod's namespace (its service account's), or "default" outside a cluster."""
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def parse_kubernetes(spec: str, namespace: Callable[[], str] = own_namespace) -> ServiceRef:
    path = urlsplit(spec.strip()).path.lstrip("/")
    name, sep, port = path.rpartition(":")
    ns, _, service = name.rpartition("/")
    if not sep or not service or "/" in ns or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{spec!r}: write a Kubernetes service as kubernetes:///[NAMESPACE/]SERVICE:PORT")
    return ServiceRef(ns or namespace(), service, int(port))


# -- the EndpointSlice protocol (pure) ------------------------------------------------------


class Gone(Exception):
    """410: the resourceVersion is too old; list again."""


class WatchError(Exception):
    """An ERROR event other than 410, or a malformed event."""


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def endpoints_of_slice(obj: dict, port: int) -> list[Endpoint]:
    """The endpoints of one EndpointSlice object (JSON as the API serves it)."""
    out = []
    for ep in obj.get("endpoints") or []:
        addresses = ep.get("addresses") or []
        if not addresses:
            continue
        conditions = ep.get("conditions") or {}
        said_ready, said_serving = conditions.get("ready"), conditions.get("serving")
        terminating = conditions.get("terminating") is True  # nil: false
        ready = said_ready is True or (said_ready is None and not terminating)  # nil: true unless terminating
        serving = said_serving is True if said_serving is not None else ready  # nil: as ready
        out.append(Endpoint(host_port(addresses[0], port), ready=ready, serving=serving, terminating=terminating,
                            node=ep.get("nodeName") or "", zone=ep.get("zone") or ""))
    return out


def resource_version(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


@dataclass
class SliceSet:
    """The Service's EndpointSlices by name, and the resourceVersion to watch from."""

    port: int
    slices: dict[str, list[Endpoint]] = field(default_factory=dict)
    version: str = ""

    def replace(self, listing: dict) -> None:
        """Take a list response (an EndpointSliceList) as the whole state."""
        self.slices = {item["metadata"]["name"]: endpoints_of_slice(item, self.port)
                       for item in listing.get("items") or []}
        self.version = resource_version(listing)

    def apply(self, event: dict) -> bool:
        """Apply one watch event; True when the endpoints changed. Raises Gone on a 410 ERROR."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", "resourceVersion too old"))
            raise WatchError(f"{obj.get('code')} {obj.get('reason', '')}: {obj.get('message', obj)}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise WatchError(f"unknown watch event {kind!r}")
        self.version = resource_version(obj) or self.version
        if kind == "BOOKMARK":
            return False
        name = obj["metadata"]["name"]
        before = self.slices.get(name)
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = endpoints_of_slice(obj, self.port)
        return self.slices.get(name) != before

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint once, by address (one listed in two slices: ready if either says so)."""
        merged: dict[str, Endpoint] = {}
        for eps in self.slices.values():
            for ep in eps:
                if ep.address not in merged or (ep.ready and not merged[ep.address].ready):
                    merged[ep.address] = ep
        return [merged[a] for a in sorted(merged)]


def usable(endpoints: list[Endpoint]) -> set[str]:
    """Addresses that may be given sessions: the ready ones; with none ready, those still serving
    while they terminate (a rollout whose new pods are not ready yet)."""
    ready = {e.address for e in endpoints if e.ready}
    return ready or {e.address for e in endpoints if e.serving}


def own_zone(endpoints: list[Endpoint], node: str) -> str:
    """The zone of an endpoint on this node, if any (how the orchestrator learns its zone)."""
    return next((e.zone for e in endpoints if node and e.node == node and e.zone), "")


def locality(node: str, zone: str, own_node: str, own_zone: str) -> int:
    """SAME_NODE, SAME_ZONE or ELSEWHERE (unknown locality counts as elsewhere)."""
    if own_node and node == own_node:
        return SAME_NODE
    if own_zone and zone == own_zone:
        return SAME_ZONE
    return ELSEWHERE


# -- sources ---------------------------------------------------------------------------------


async def resolve(name: str) -> list[str]:
    """Every address a `host:port` name resolves to, as `ip:port` (IPv6 in brackets)."""
    host, _, port = name.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=0, proto=6)
    return sorted({host_port(sockaddr[0], int(port)) for *_, sockaddr in infos})


class Source(Protocol):
    """Where one role's replicas are (a spec's form)."""

    spec: str

    async def endpoints(self) -> list[Endpoint]:
        """The replicas now; OSError when they cannot be known (the caller keeps the last list)."""

    async def wait(self, timeout_s: float) -> None:
        """Return after `timeout_s`, or earlier when the endpoints changed."""

    def close(self) -> None: ...


class StaticSource:
    """Fixed addresses, always ready."""

    def __init__(self, spec: str, addresses: list[str]) -> None:
        self.spec, self._endpoints = spec, [Endpoint(a) for a in addresses]

    async def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    async def wait(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)

    def close(self) -> None:
        pass


class DnsSource(StaticSource):
    """Every address a name resolves to, resolved again at each refresh."""

    def __init__(self, spec: str, name: str) -> None:
        super().__init__(spec, [])
        self.name = name

    async def endpoints(self) -> list[Endpoint]:
        return [Endpoint(a) for a in await resolve(self.name)]


def source_of(spec: str) -> Source:
    if spec.strip().startswith("kubernetes:"):
        return KubernetesSource(spec, parse_kubernetes(spec))
    addresses, name = parse_addresses(spec)
    if name:
        return DnsSource(spec, name)
    if not addresses:
        raise ValueError("no address given")
    return StaticSource(spec, addresses)


def api_client():
    """A `kubernetes` ApiClient: $SPECDEC_KUBERNETES_API (no credentials; for tests and `kubectl
    proxy`), else the in-cluster service account, else $KUBECONFIG."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if os.environ.get(API_ENV):
        configuration.host = os.environ[API_ENV].rstrip("/")
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    elif os.environ.get("KUBECONFIG"):
        config.load_kube_config(client_configuration=configuration)
    else:
        raise config.ConfigException(f"not in a cluster, and neither ${API_ENV} nor $KUBECONFIG is set")
    configuration.retries = False  # the watch loop retries, with backoff (urllib3's would log each try)
    return client.ApiClient(configuration)


class SliceWatch:
    """List, then watch, a Service's EndpointSlices in a daemon thread.

    `deliver(endpoints)` is called from the thread after every change, `deliver(None)` when the
    API cannot be listed (the reason is in `self.error`).
    """

    def __init__(self, ref: ServiceRef, deliver: Callable[[list[Endpoint] | None], None],
                 make_client: Callable = api_client, backoff_s: tuple[float, float] = (0.5, 30.0),
                 watch_timeout_s: int = 300) -> None:
        self.ref, self.deliver, self.make_client = ref, deliver, make_client
        self.backoff_s, self.watch_timeout_s = backoff_s, watch_timeout_s
        self.state = SliceSet(ref.port)
        self.error = ""
        self.lists = 0  # list calls that succeeded (relists included)
        self._stop = threading.Event()
        self._response = None
        self._thread = threading.Thread(target=self._run, name=f"endpointslices-{ref.service}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # unblock the thread's read
                (getattr(response, "shutdown", None) or response.close)()

    def _run(self) -> None:
        delay = self.backoff_s[0]
        api, gone = None, False
        while not self._stop.is_set():
            try:
                api = api or self._api()
                self._list(api)
            except Exception as exc:  # noqa: BLE001 - the API does not answer: DNS until it does
                self.error = f"{type(exc).__name__}: {exc}"
                self.deliver(None)
            else:
                try:
                    while not self._stop.is_set():
                        self._watch(api)
                        delay, gone = self.backoff_s[0], False  # a watch ran to its end: the API is fine
                except Gone as exc:
                    log.info("watch of the %s endpoints expired (%s); listing again", self.ref.service, exc)
                    gone = not gone  # at once; after a backoff if the fresh list's version is gone too
                    if gone:
                        continue
                except Exception as exc:  # noqa: BLE001 - any other failure: relist after the backoff
                    log.info("watch of the %s endpoints failed (%s: %s); listing again in %.1fs", self.ref.service,
                             type(exc).__name__, exc, delay)
            self._stop.wait(delay)
            delay = min(delay * 2, self.backoff_s[1])

    def _api(self):
        from kubernetes import client

        return client.DiscoveryV1Api(self.make_client())

    def _list(self, api) -> None:
        response = api.list_namespaced_endpoint_slice(
            self.ref.namespace, label_selector=self.ref.label_selector, _preload_content=False,
            _request_timeout=(5, 30))
        self.state.replace(json.loads(response.data))
        self.lists += 1
        self.error = ""
        self.deliver(self.state.endpoints())

    def _watch(self, api) -> None:
        """One watch request, until the server ends it; each change is delivered as it comes."""
        try:
            self._response = api.list_namespaced_endpoint_slice(
                self.ref.namespace, label_selector=self.ref.label_selector, watch=True,
                resource_version=self.state.version, allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s, _preload_content=False,
                _request_timeout=(5, self.watch_timeout_s + 30))
        except Exception as exc:
            if getattr(exc, "status", None) == 410:
                raise Gone(str(getattr(exc, "reason", exc))) from exc
            raise
        try:
            for line in lines_of(self._response):
                if self._stop.is_set():
                    return
                if self.state.apply(json.loads(line)):
                    self.deliver(self.state.endpoints())
        finally:
            response, self._response = self._response, None
            with contextlib.suppress(Exception):
                response.release_conn()


def lines_of(response) -> Iterator[str]:
    """The newline-separated JSON lines of a streamed watch response."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        yield from (line.decode() for line in complete if line.strip())
    if buffer.strip():
        yield buffer.decode()


class KubernetesSource:
    """The endpoints of a Service, watched through the API; its DNS name while the API is down."""

    def __init__(self, spec: str, ref: ServiceRef, fallback: str | None = None, make_client: Callable = api_client,
                 first_list_s: float = 10.0, **watch_options) -> None:
        self.spec, self.ref = spec, ref
        self.fallback = fallback or ref.dns_name
        self.first_list_s = first_list_s
        self.watch = SliceWatch(ref, self._deliver, make_client, **watch_options)
        self.mode = "starting"  # "api" or "dns" once the watch thread has answered
        self._endpoints: list[Endpoint] = []
        self._changed = asyncio.Event()
        self._answered = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self.watch.start()

    def _deliver(self, endpoints: list[Endpoint] | None) -> None:  # in the watch thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: the orchestrator is stopping
            self._loop.call_soon_threadsafe(self._update, endpoints)

    def _update(self, endpoints: list[Endpoint] | None) -> None:
        mode = "dns" if endpoints is None else "api"
        if mode != self.mode:
            if mode == "dns":
                log.warning("Kubernetes API not reachable for the endpoints of %s/%s (%s); resolving %s until it "
                            "answers", self.ref.namespace, self.ref.service, self.watch.error, self.fallback)
            elif self.mode == "dns":
                log.warning("Kubernetes API answers again: watching the endpoints of %s/%s", self.ref.namespace,
                            self.ref.service)
            self.mode = mode
            self._changed.set()
        if endpoints is not None and endpoints != self._endpoints:
            self._endpoints = endpoints
            self._changed.set()
        self._answered.set()

    async def endpoints(self) -> list[Endpoint]:
        self.start()
        if not self._answered.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._answered.wait(), self.first_list_s)
        if self.mode == "api":
            return list(self._endpoints)
        return [Endpoint(a) for a in await resolve(self.fallback)]

    async def wait(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        self._changed.clear()

    def close(self) -> None:
        self.watch.stop()


def locality_from_env() -> tuple[str, str]:
    """This orchestrator's (node, zone): $SPECDEC_NODE_NAME and $SPECDEC_ZONE (empty when unset)."""
    return os.environ.get(NODE_ENV, ""), os.environ.get(ZONE_ENV, "")
