"""The node directory on Redis Cluster (``redis-cluster://``): a node's transport address,
kept beside the block index's buckets (``redis_cluster.bucket_prefixes``)."""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.cluster import RedisCluster

from .node_directory import NodeAddress, decode_address, encode_address

__all__ = ["RedisClusterNodeDirectory"]

_DIRECTORY_TROUBLE = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


class RedisClusterNodeDirectory:
    """``NodeDirectory`` on a cluster: the address under ``<bucket prefix>:addr:<node_id>`` in
    three buckets a third of the slot space apart (so, with even slot ranges, on three shards),
    announced with each heartbeat and read from the first that answers."""

    def __init__(self, client: RedisCluster, bucket_prefixes: Sequence[str]) -> None:
        self._client = client
        self._prefixes = list(bucket_prefixes)

    def _keys(self, node_id: str) -> list[str]:
        num = len(self._prefixes)
        home = int.from_bytes(node_id.encode()[-4:].rjust(4, b"\0"), "big") % num
        buckets = dict.fromkeys((home + k * num // 3) % num for k in range(3))
        return [f"{self._prefixes[b]}:addr:{node_id}" for b in buckets]

    def announce(self, node_id: str, address: NodeAddress, *, ttl_s: float) -> None:
        value = encode_address(address)
        for key in self._keys(node_id):
            try:
                self._client.set(key, value, px=max(int(ttl_s * 1000), 1))
            except _DIRECTORY_TROUBLE:
                continue  # that bucket's shard is down; the others carry the address

    def lookup(self, node_id: str) -> NodeAddress | None:
        for key in self._keys(node_id):
            try:
                raw = self._client.get(key)
            except _DIRECTORY_TROUBLE:
                continue
            if raw is None:
                return None
            try:
                return decode_address(raw)
            except ValueError:
                return None  # a garbage entry
        return None

    def withdraw(self, node_id: str) -> None:
        for key in self._keys(node_id):
            try:
                self._client.delete(key)
            except _DIRECTORY_TROUBLE:
                continue

    def interrupt(self) -> None:
        self._client.disconnect_connection_pools()
