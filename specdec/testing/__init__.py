"""Helpers for tests and benchmarks: small real models built offline (`tiny`).

Not serving code: nothing in the library or the services imports this package.
"""
