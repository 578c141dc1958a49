"""Every Redis key specdec writes, in one place.

Keys are namespaced and versioned (`specdec:v1`), and a session's keys carry its id as a hash
tag (`{<session>}`) so that they share one Redis Cluster slot and a Lua script may touch them
together. What each key holds and how long it lives: docs/state.md.
"""

from __future__ import annotations

PREFIX = "specdec:v1"

# The draft-length prior new sessions start from (evictable, shared by all sessions).
PRIOR_KEY = f"{PREFIX}:policy-prior"


def session_meta_key(session_id: str) -> str:
    """Hash: `version` and `state` (the session record as JSON). Must not be lost."""
    return f"{PREFIX}:{{{session_id}}}:meta"


def session_tokens_key(session_id: str) -> str:
    """List: the session's whole token history. Must not be lost."""
    return f"{PREFIX}:{{{session_id}}}:tokens"


def snapshot_meta_key(session_id: str, role: str) -> str:
    """Hash describing a KV snapshot of `role` ("target" or "draft"). An evictable cache."""
    return f"{PREFIX}:{{{session_id}}}:kv:{role}:meta"


def snapshot_chunk_key(session_id: str, role: str, i: int, tag: str = "") -> str:
    """Chunk `i` of a KV snapshot blob (`tag` marks a temporary key being written)."""
    return f"{PREFIX}:{{{session_id}}}:kv:{role}:{tag}{i}"


def suffix_outputs_key() -> str:
    """Stream (capped with MAXLEN): finished outputs, each entry a field `tokens` of uint32
    little-endian token ids (`specdec.core.suffix.encode_output`), read by every suffix-speculation
    draft replica into its corpus. Shared by all sessions; evictable (only speed depends on it)."""
    return f"{PREFIX}:suffix:outputs"


def prefix_block_key(role: str, identity: str, name: str) -> str:
    """Where a shared prefix block lies: `<segment>:<block index>` of the segment blob holding it
    (stored as a KV snapshot of role `<role>-prefix` under the segment's id). `identity`: a hash of
    the model, dtype and tokenizer the keys/values belong to; `name`: the block's chained hash."""
    return f"{PREFIX}:prefix:{role}:{identity}:{name}"


def owed_releases_key(address: str) -> str:
    """Hash: the sessions whose Release the replica at `address` did not answer (down, restarting),
    field a session id, value "1" when its output must not join a corpus ("0": it may). Read by
    every orchestrator once the replica answers again; expires with the session TTL."""
    return f"{PREFIX}:owed-releases:{address}"
