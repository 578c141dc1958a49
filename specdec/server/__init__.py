"""Plumbing every service shares: config base, admission, auth, TLS, limits, logs, metrics,
tracing, interceptors, the gRPC server wiring and the protobuf <-> domain conversions.

SDK users never import this package; the draft, target and orchestrator services and the HTTP
gateway build on it.
"""
