"""The orchestrator: runs the speculative loop per session and serves the public API."""
