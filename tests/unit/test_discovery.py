"""Replica discovery: the EndpointSlice protocol as pure functions, placement by readiness and
locality, then the watch against a stand-in API server on 127.0.0.1 (tests/k8s_stand_in.py)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.backends import DraftReply
from orchestrator.discovery import (
    ELSEWHERE,
    SAME_NODE,
    SAME_ZONE,
    DnsSource,
    Endpoint,
    Gone,
    KubernetesSource,
    ServiceRef,
    SliceSet,
    StaticSource,
    WatchError,
    endpoints_of_slice,
    locality,
    own_zone,
    parse_kubernetes,
    source_of,
    usable,
)
from orchestrator.replicas import Replica, TargetPool
from specdec.core.sampling import SamplingParams
from tests.k8s_stand_in import StandIn, endpoint, status
from tests.unit.test_replicas import FakeTarget, verify

ROUND = (DraftReply(), SamplingParams(), 0)  # the rest of a verify call's arguments


def slice_of(name: str, *endpoints: dict, version: int = 1) -> dict:
    return {"metadata": {"name": name, "resourceVersion": str(version)}, "endpoints": list(endpoints)}


# -- specs -------------------------------------------------------------------------------------


def test_parse_kubernetes_with_and_without_namespace():
    assert parse_kubernetes("kubernetes:///prod/target:50053") == ServiceRef("prod", "target", 50053)
    assert parse_kubernetes("kubernetes:///target:50053", namespace=lambda: "mine") == ServiceRef("mine", "target",
                                                                                                   50053)
    ref = ServiceRef("prod", "target", 50053)
    assert ref.label_selector == "kubernetes.io/service-name=target"
    assert ref.dns_name == "target.prod.svc:50053"
    for bad in ("kubernetes:///target", "kubernetes:///a/b/target:1", "kubernetes:///prod/:1", "kubernetes:///t:0"):
        with pytest.raises(ValueError):
            parse_kubernetes(bad)


def test_source_of_each_form():
    assert isinstance(source_of("a:1,b:2"), StaticSource)
    assert isinstance(source_of("dns:///svc:1"), DnsSource)
    assert isinstance(source_of("kubernetes:///ns/svc:1"), KubernetesSource)
    with pytest.raises(ValueError):
        source_of(" , ")


# -- EndpointSlices to endpoints -----------------------------------------------------------------


def test_conditions_follow_the_api_defaults():
    eps = endpoints_of_slice(slice_of(
        "s",
        {"addresses": ["10.0.0.1"], "nodeName": "n1", "zone": "z1"},  # no conditions: ready
        endpoint("10.0.0.2", ready=False),
        endpoint("10.0.0.3", ready=False, serving=True, terminating=True),  # draining
        endpoint("fd00::4", ready=None, terminating=True),  # nil ready while terminating: not ready
        {"addresses": [], "conditions": {"ready": True}},  # no address: skipped
    ), 50053)
    assert eps == [
        Endpoint("10.0.0.1:50053", ready=True, serving=True, node="n1", zone="z1"),
        Endpoint("10.0.0.2:50053", ready=False, serving=False),
        Endpoint("10.0.0.3:50053", ready=False, serving=True, terminating=True),
        Endpoint("[fd00::4]:50053", ready=False, serving=False, terminating=True),
    ]


def test_usable_is_the_ready_ones_else_those_still_serving():
    ready, draining, dead = (Endpoint("a:1"), Endpoint("b:1", ready=False, serving=True, terminating=True),
                             Endpoint("c:1", ready=False, serving=False))
    assert usable([ready, draining, dead]) == {"a:1"}
    assert usable([draining, dead]) == {"b:1"}  # a rollout: the old pods drain, the new are not ready
    assert usable([dead]) == set()


# -- watch events --------------------------------------------------------------------------------


def test_events_add_modify_delete_and_flip_readiness():
    state = SliceSet(7)
    state.replace({"metadata": {"resourceVersion": "10"}, "items": [slice_of("s1", endpoint("10.0.0.1"))]})
    assert state.version == "10" and [e.address for e in state.endpoints()] == ["10.0.0.1:7"]

    assert state.apply({"type": "ADDED", "object": slice_of("s2", endpoint("10.0.0.2"), version=11)})
    assert [e.address for e in state.endpoints()] == ["10.0.0.1:7", "10.0.0.2:7"] and state.version == "11"

    assert state.apply({"type": "MODIFIED", "object": slice_of("s1", endpoint("10.0.0.1", ready=False), version=12)})
    assert [e.ready for e in state.endpoints()] == [False, True]
    assert not state.apply({"type": "MODIFIED", "object": slice_of("s1", endpoint("10.0.0.1", ready=False),
                                                                    version=13)})  # nothing changed
    assert state.apply({"type": "MODIFIED", "object": slice_of("s1", endpoint("10.0.0.1"), version=14)})
    assert all(e.ready for e in state.endpoints())

    assert state.apply({"type": "DELETED", "object": slice_of("s2", endpoint("10.0.0.2"), version=15)})
    assert [e.address for e in state.endpoints()] == ["10.0.0.1:7"] and state.version == "15"
    assert not state.apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}})
    assert state.version == "20"


def test_an_address_in_two_slices_is_ready_if_either_says_so():
    state = SliceSet(7)
    state.replace({"metadata": {"resourceVersion": "1"}, "items": [
        slice_of("old", endpoint("10.0.0.1", ready=False)), slice_of("new", endpoint("10.0.0.1"))]})
    assert state.endpoints() == [Endpoint("10.0.0.1:7")]


def test_a_410_error_event_asks_for_a_relist_and_other_errors_fail_the_watch():
    state = SliceSet(7)
    with pytest.raises(Gone):
        state.apply({"type": "ERROR", "object": status(410, "Expired", "too old resource version: 1 (5)")})
    with pytest.raises(WatchError, match="500"):
        state.apply({"type": "ERROR", "object": status(500, "InternalError", "etcd is sad")})
    with pytest.raises(WatchError):
        state.apply({"type": "SURPRISE", "object": {}})


# -- locality ------------------------------------------------------------------------------------


def test_locality_tiers():
    assert locality("n1", "z1", "n1", "z1") == SAME_NODE
    assert locality("n2", "z1", "n1", "z1") == SAME_ZONE
    assert locality("n2", "z2", "n1", "z1") == ELSEWHERE
    assert locality("", "", "", "") == ELSEWHERE  # nothing known: no preference
    assert own_zone([Endpoint("a:1", node="n2", zone="z2"), Endpoint("b:1", node="n1", zone="z1")], "n1") == "z1"
    assert own_zone([Endpoint("a:1", node="n2", zone="z2")], "n1") == ""


def pool_at(endpoints: list[Endpoint], node: str = "", zone: str = "") -> TargetPool:
    """A pool fed `endpoints` by discovery, each replica already probed."""
    pool = TargetPool("kubernetes:///ns/target:1", FakeTarget, retry_s=60.0, node=node, zone=zone,
                      source=StaticSource("test", []))
    pool.update(endpoints)
    for replica in pool.replicas.values():
        replica.fingerprint = "fp"
    return pool


def placed(pool: TargetPool, session: str) -> str:
    verify(pool, session)
    return pool._affinity[session]


def test_new_sessions_prefer_the_same_node_then_the_same_zone():
    far, zone, node = (Endpoint("far:1", node="n3", zone="z2"), Endpoint("zone:1", node="n2", zone="z1"),
                       Endpoint("node:1", node="n1", zone="z1"))
    pool = pool_at([far, zone, node], node="n1")
    assert pool.zone == "z1"  # learnt from the endpoint on its own node
    assert placed(pool, "s1") == "node:1"
    pool.update([far, zone, Endpoint("node:1", ready=False, node="n1", zone="z1")])
    assert placed(pool, "s2") == "zone:1"
    pool.update([far, Endpoint("zone:1", ready=False, node="n2", zone="z1"),
                 Endpoint("node:1", ready=False, node="n1", zone="z1")])
    assert placed(pool, "s3") == "far:1"  # never an unready replica, however near


def test_locality_is_a_preference_load_still_counts():
    pool = pool_at([Endpoint("far:1", node="n2"), Endpoint("near:1", node="n1")], node="n1")

    def place(session: str, near_in_flight: int) -> str:
        for replica in pool.replicas.values():
            replica.rtt_s, replica.compute_s = 0.01, 0.0
        pool.replicas["near:1"].in_flight = near_in_flight
        return pool.pick(session).address

    assert place("s1", 0) == "near:1"
    assert place("s2", 3) == "near:1"  # four times the cost of far, a quarter of its weight: a tie, near wins
    assert place("s3", 4) == "far:1"


def test_a_session_leaves_its_replica_once_it_is_not_ready_and_when_it_is_gone():
    async def scenario():
        a, b = Endpoint("a:1", node="n1"), Endpoint("b:1", node="n2")
        pool = pool_at([a, b], node="n1")
        assert (await pool.verify("s", [1], *ROUND)) and pool._affinity["s"] == "a:1"
        pool.update([Endpoint("a:1", ready=False, node="n1"), b])
        await pool.verify("s", [1, 2], *ROUND)
        assert pool._affinity["s"] == "b:1" and "a:1" in pool.replicas  # kept: release still reaches it
        pool.update([Endpoint("a:1", node="n1"), b])
        await pool.verify("s", [1, 2, 3], *ROUND)
        assert pool._affinity["s"] == "b:1"  # sticky: its cache is on b now
        pool.update([a])
        await pool.verify("s", [1, 2, 3, 4], *ROUND)
        assert pool._affinity["s"] == "a:1" and set(pool.replicas) == {"a:1"}
        await asyncio.sleep(0)  # the retired replica's channel is closed

    asyncio.run(scenario())


def test_replica_not_ready_is_not_healthy():
    replica = Replica(FakeTarget("a:1"), fingerprint="fp")
    assert replica.healthy(0.0)
    replica.ready = False
    assert not replica.healthy(0.0)


# -- against the stand-in API server -------------------------------------------------------------


@pytest.fixture
def api(monkeypatch):
    server = StandIn().start()
    monkeypatch.setenv("SPECDEC_KUBERNETES_API", server.url)
    yield server
    server.stop()


def source_for(ref: ServiceRef, fallback: str = "localhost:5000") -> KubernetesSource:
    return KubernetesSource(f"kubernetes:///{ref.namespace}/{ref.service}:{ref.port}", ref, fallback=fallback,
                            first_list_s=5.0, backoff_s=(0.05, 0.2), watch_timeout_s=5)


async def until(source: KubernetesSource, check, timeout_s: float = 10.0) -> list[Endpoint]:
    """Wait for the source's changes until `check(endpoints)` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        endpoints = await source.endpoints()
        if check(endpoints):
            return endpoints
        assert asyncio.get_running_loop().time() < deadline, f"still {endpoints}"
        await source.wait(0.2)


def ready_addresses(endpoints: list[Endpoint]) -> list[str]:
    return [e.address for e in endpoints if e.ready]


@pytest.mark.timeout(60)
def test_discovery_follows_adds_removes_and_readiness(api):
    ref = ServiceRef("ns", "target", 5000)
    api.put_slice("ns", "target-a", "target", [endpoint("10.0.0.1", node="n1")])
    api.put_slice("ns", "other-a", "other", [endpoint("10.9.9.9")])  # another Service: not ours
    api.put_slice("elsewhere", "target-a", "target", [endpoint("10.8.8.8")])  # another namespace

    async def scenario():
        source = source_for(ref)
        try:
            assert [e.address for e in await source.endpoints()] == ["10.0.0.1:5000"]
            assert source.mode == "api" and (await source.endpoints())[0].node == "n1"
            api.put_slice("ns", "target-b", "target", [endpoint("10.0.0.2")])
            await until(source, lambda eps: ready_addresses(eps) == ["10.0.0.1:5000", "10.0.0.2:5000"])
            api.put_slice("ns", "target-a", "target", [endpoint("10.0.0.1", ready=False, node="n1")])
            await until(source, lambda eps: ready_addresses(eps) == ["10.0.0.2:5000"] and len(eps) == 2)
            api.delete_slice("ns", "target-a")
            await until(source, lambda eps: [e.address for e in eps] == ["10.0.0.2:5000"])
        finally:
            source.close()

    asyncio.run(scenario())
    assert api.count("list ns") == 1  # one list, then the watch carried every change


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gone_as_event", [False, True], ids=["410-status", "410-error-event"])
def test_discovery_relists_after_410_gone(api, gone_as_event):
    api.gone_as_event = gone_as_event
    ref = ServiceRef("ns", "target", 5000)
    api.put_slice("ns", "target-a", "target", [endpoint("10.0.0.1")])

    async def scenario():
        source = source_for(ref)
        try:
            await until(source, lambda eps: ready_addresses(eps) == ["10.0.0.1:5000"])
            # The watch ends, a change is made, and the history that held it is forgotten: the
            # watch from the old resourceVersion is answered 410, and only a relist shows the change.
            api.expire(lambda: api.put_slice("ns", "target-b", "target", [endpoint("10.0.0.2")]))
            await until(source, lambda eps: ready_addresses(eps) == ["10.0.0.1:5000", "10.0.0.2:5000"])
            api.put_slice("ns", "target-a", "target", [endpoint("10.0.0.1", ready=False)])  # watched again
            await until(source, lambda eps: ready_addresses(eps) == ["10.0.0.2:5000"])
        finally:
            source.close()

    asyncio.run(scenario())
    assert api.count("list ns") == 2


@pytest.mark.timeout(60)
def test_discovery_falls_back_to_dns_while_the_api_is_down(api):
    ref = ServiceRef("ns", "target", 5000)
    api.put_slice("ns", "target-a", "target", [endpoint("10.0.0.1")])

    async def scenario():
        source = source_for(ref, fallback="localhost:5000")
        try:
            await until(source, lambda eps: ready_addresses(eps) == ["10.0.0.1:5000"])
            api.stop()
            endpoints = await until(source, lambda eps: source.mode == "dns")
            assert {e.address for e in endpoints} & {"127.0.0.1:5000", "[::1]:5000"}
            assert "10.0.0.1:5000" not in [e.address for e in endpoints]
            api.put_slice("ns", "target-b", "target", [endpoint("10.0.0.2")])  # while down
            api.start()  # same port: the API answers again
            await until(source, lambda eps: source.mode == "api" and len(eps) == 2)
        finally:
            source.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_discovery_without_any_api_resolves_dns_from_the_start(monkeypatch):
    for name in ("SPECDEC_KUBERNETES_API", "KUBERNETES_SERVICE_HOST", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)

    async def scenario():
        source = source_for(ServiceRef("ns", "target", 5000), fallback="localhost:5000")
        try:
            endpoints = await source.endpoints()
            assert source.mode == "dns" and "not in a cluster" in source.watch.error
            assert {e.address for e in endpoints} & {"127.0.0.1:5000", "[::1]:5000"}
        finally:
            source.close()

    asyncio.run(scenario())
