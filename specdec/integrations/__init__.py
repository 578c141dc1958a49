"""specdec's draft pool behind other engines (`specdec.integrations.vllm`: vLLM's proposer interface).

Importing this package loads nothing of the engines it serves: each one's module is loaded by that
engine, from its own configuration.
"""
