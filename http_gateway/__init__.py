"""OpenAI-compatible HTTP API in front of the orchestrator (`python -m http_gateway`)."""
