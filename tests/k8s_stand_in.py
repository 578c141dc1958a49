"""A stand-in Kubernetes API server for EndpointSlices, on 127.0.0.1, for the discovery tests.

It speaks the real protocol over HTTP, for the one resource the orchestrator reads:
  GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=kubernetes.io/service-name=S
      an EndpointSliceList with metadata.resourceVersion;
  the same with watch=1&resourceVersion=N
      a chunked stream of JSON lines {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}
      of every change after N, until timeoutSeconds (or `close_watches()`); a resourceVersion older
      than the last `compact()` answers 410 Gone, as an HTTP status or, with `gone_as_event`, as an
      ERROR event (the real server does either, depending on where the watch is served from).
The test changes the state with `put_slice` / `delete_slice`; open watches see it at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
SERVICE_LABEL = "kubernetes.io/service-name"


def endpoint(ip: str, ready: bool | None = True, node: str = "", zone: str = "", serving: bool | None = None,
             terminating: bool | None = None) -> dict:
    """One endpoint of an EndpointSlice, as the API serves it (a None condition is left out)."""
    conditions = {k: v for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
                  if v is not None}
    out: dict = {"addresses": [ip], "conditions": conditions}
    if node:
        out["nodeName"] = node
    if zone:
        out["zone"] = zone
    return out


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class StandIn:
    """The API server's state (slices by namespace and name, an event history) and its HTTP server."""

    def __init__(self, port: int = 0, gone_as_event: bool = False) -> None:
        self.gone_as_event = gone_as_event
        self.version = 100
        self.oldest = 0  # watches from before this resourceVersion get 410 Gone
        self.slices: dict[tuple[str, str], dict] = {}
        self.history: list[tuple[int, str, str, dict]] = []  # (version, namespace, type, object)
        self.requests: list[str] = []  # "list NS" / "watch NS from N"
        self.cond = threading.Condition()
        self._epoch = 0  # bumped by close_watches()
        self._port = port
        self.server: ThreadingHTTPServer | None = None

    # -- state, as the test changes it ---------------------------------------------------------

    def put_slice(self, namespace: str, name: str, service: str, endpoints: list[dict], port: int = 0) -> None:
        with self.cond:
            self.version += 1
            kind = "MODIFIED" if (namespace, name) in self.slices else "ADDED"
            obj = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "addressType": "IPv4",
                   "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(self.version),
                                "labels": {SERVICE_LABEL: service}},
                   "endpoints": endpoints, "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}]}
            self.slices[(namespace, name)] = obj
            self.history.append((self.version, namespace, kind, obj))
            self.cond.notify_all()

    def delete_slice(self, namespace: str, name: str) -> None:
        with self.cond:
            self.version += 1
            obj = json.loads(json.dumps(self.slices.pop((namespace, name))))
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.history.append((self.version, namespace, "DELETED", obj))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch from an older resourceVersion gets 410 Gone."""
        with self.cond:
            self.oldest = self.version
            self.history.clear()

    def expire(self, change: Callable[[], None]) -> None:
        """End the open watches, make `change` and forget the history, all at once: the watchers
        come back with a resourceVersion that is gone and must list again to see `change`."""
        with self.cond:
            self.close_watches()
            change()
            self.compact()

    def close_watches(self) -> None:
        """End every open watch (as an API server restart or a load balancer would)."""
        with self.cond:
            self._epoch += 1
            self.cond.notify_all()

    def count(self, prefix: str) -> int:
        return sum(r.startswith(prefix) for r in list(self.requests))

    # -- the server ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> StandIn:
        self.server = ThreadingHTTPServer(("127.0.0.1", self._port), _handler(self))
        self.server.daemon_threads = True
        self._port = self.server.server_address[1]  # kept: a restart serves on the same port
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop answering (connections are refused until `start()`); open watches end."""
        server, self.server = self.server, None
        self.close_watches()
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> StandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what the handler serves -------------------------------------------------------------------

    def listing(self, namespace: str, service: str) -> dict:
        with self.cond:
            items = [obj for (ns, _), obj in sorted(self.slices.items())
                     if ns == namespace and obj["metadata"]["labels"].get(SERVICE_LABEL) == service]
            return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)}, "items": items}

    def events(self, namespace: str, service: str, since: int, timeout_s: float):
        """The watch's events after `since`, as they happen, until `timeout_s` or close_watches()."""
        epoch, deadline = self._epoch, time.monotonic() + timeout_s
        sent = since
        while True:
            with self.cond:
                if self._epoch != epoch or self.server is None:  # closed, or the server stopped
                    return
                fresh = [(v, t, o) for v, ns, t, o in self.history
                         if v > sent and ns == namespace and o["metadata"]["labels"].get(SERVICE_LABEL) == service]
                if not fresh:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self.cond.wait(min(left, 0.5))
                    continue
            for version, kind, obj in fresh:
                sent = version
                yield {"type": kind, "object": obj}


def _handler(api: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            parts = url.path[len(PREFIX):].split("/") if url.path.startswith(PREFIX) else []
            selector = query.get("labelSelector", "")
            if len(parts) != 2 or parts[1] != "endpointslices" or not selector.startswith(SERVICE_LABEL + "="):
                return self.reply(HTTPStatus.NOT_FOUND, status(404, "NotFound", f"{self.path} is not served here"))
            namespace, service = parts[0], selector.split("=", 1)[1]
            if query.get("watch") not in ("1", "true"):
                api.requests.append(f"list {namespace}")
                return self.reply(HTTPStatus.OK, api.listing(namespace, service))
            since = int(query.get("resourceVersion") or 0)
            api.requests.append(f"watch {namespace} from {since}")
            gone = since < api.oldest
            if gone and not api.gone_as_event:
                return self.reply(HTTPStatus.GONE, status(410, "Expired", f"too old resource version: {since}"))
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                if gone:
                    self.chunk({"type": "ERROR", "object": status(410, "Expired", f"too old resource version: "
                                                                                   f"{since}")})
                else:
                    for event in api.events(namespace, service, since, float(query.get("timeoutSeconds", 300))):
                        self.chunk(event)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the client went away
            self.close_connection = True

        def chunk(self, event: dict) -> None:
            data = json.dumps(event).encode() + b"\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def reply(self, code: HTTPStatus, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
