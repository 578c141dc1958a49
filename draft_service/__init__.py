"""The draft service: a small, fast proposer that streams draft tokens over gRPC."""
