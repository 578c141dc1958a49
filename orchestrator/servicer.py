"""gRPC translation for the public API; the logic lives in orchestrator.generation (Orchestrator)."""

from __future__ import annotations

import contextlib

from orchestrator.generation import Orchestrator
from orchestrator.status import status
from specdec.errors import InvalidArgument
from specdec.rpc_errors import grpc_errors
from specdec.server.admission import deadline_of
from specdec.server.auth import current_principal
from specdec.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    @grpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        spec = self.orchestrator.parse(request, principal=current_principal())
        chunks = self.orchestrator.generate(spec, deadline_of(context), context)
        async with contextlib.aclosing(chunks):  # closed with this handler: cleanup runs at once
            async for chunk in chunks:
                yield chunk

    @grpc_errors
    async def GenerateUnary(self, request: pb.GenerateRequest, context):
        spec = self.orchestrator.parse(request, principal=current_principal())
        reply = pb.GenerateResponse()
        async with contextlib.aclosing(self.orchestrator.generate(spec, deadline_of(context), context)) as chunks:
            async for chunk in chunks:
                reply.session_id = chunk.session_id
                reply.token_ids.extend(chunk.token_ids)
                reply.logprobs.extend(chunk.logprobs)
                reply.prompt_logprobs.extend(chunk.prompt_logprobs)
                reply.text += chunk.text
                reply.finish_reason = chunk.finish_reason
                if chunk.HasField("stats"):
                    reply.stats.CopyFrom(chunk.stats)
        return reply

    @grpc_errors
    async def CloseSession(self, request: pb.CloseSessionRequest, context):
        if not request.session_id:
            raise InvalidArgument("session_id is empty")
        closed = await self.orchestrator.close_session(request.session_id, principal=current_principal())
        return pb.CloseSessionResponse(closed=closed)

    @grpc_errors
    async def GetStatus(self, request: pb.GetStatusRequest, context):
        orchestrator = self.orchestrator
        return await status(orchestrator.counters, orchestrator.probes, orchestrator.config.draft_length)
