"""Every service answers the standard gRPC health check (Check and List) and lists and describes its
services by reflection, under v1 and v1alpha."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

EXPECTED = {
    "orchestrator": "specdec.v1.Orchestrator",
    "draft": "specdec.v1.DraftService",
    "target": "specdec.v1.TargetService",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_health_and_reflection(tiny_pipeline, name):
    address = tiny_pipeline.plan.grpc_addresses()[name]
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", EXPECTED[name]):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        listed = health.List(health_pb2.HealthListRequest(), timeout=5).statuses
        assert {s: r.status for s, r in listed.items()} == {"": health_pb2.HealthCheckResponse.SERVING,
                                                            EXPECTED[name]: health_pb2.HealthCheckResponse.SERVING}
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(reflection.ServerReflectionInfo(iter([request]), timeout=5)))
        names = {s.name for s in reply.list_services_response.service}
        # v1: the same messages under grpc.reflection.v1 (what grpcurl asks first)
        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                   request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        asks = [request, reflection_pb2.ServerReflectionRequest(file_containing_symbol=EXPECTED[name])]
        listed_v1, described = list(v1(iter(asks), timeout=5))
    assert {EXPECTED[name], "grpc.health.v1.Health"} <= names
    assert {s.name for s in listed_v1.list_services_response.service} == names
    assert described.file_descriptor_response.file_descriptor_proto  # the service's .proto, serialized
