"""A node's entries read back from Redis with plain commands, for tests and tools (not atomic,
not a hot path). Key and value layout: ``redis_scripts.py``."""

from __future__ import annotations

import struct

import redis

__all__ = ["read_node_entries"]


def read_node_entries(
    client: redis.Redis, prefix: str, node_id: str
) -> set[tuple[int, bytes, int]] | None:
    """``(group_id, lookup key, block_id)`` of each entry of ``node_id``'s live incarnation
    under key prefix ``prefix``; None when the node is not registered there. Raises what
    redis-py raises (the caller counts it as Redis trouble)."""
    inc = client.execute_command("GET", f"{prefix}:node:{node_id}")
    if inc is None:
        return None
    ekeys = list(client.execute_command("SMEMBERS", f"{prefix}:keys:{node_id}"))
    pipe = client.pipeline(transaction=False)
    for ekey in ekeys:
        pipe.hget(ekey, node_id)
    values = pipe.execute()
    head = len(prefix.encode()) + len(":e:")
    out: set[tuple[int, bytes, int]] = set()
    for ekey, value in zip(ekeys, values, strict=True):
        if value is None or len(value) < 30 or value[:20] != inc:
            continue  # another incarnation's, or garbage
        group, _, key = ekey[head:].partition(b":")
        out.add((int(group), key, struct.unpack(">I", value[20:24])[0]))
    return out
