"""The block index against a Redis that asks for a password, and one that speaks only TLS
(issue 15, "Security"): ``redis://:PASSWORD@host:port/db`` and ``rediss://...`` index URLs
work end to end through ``open_index`` (the index and the node directory); a wrong or missing
password, or plain TCP to the TLS port, is backend trouble (no hit, ``available`` False, never
an exception in the caller), and no error message repeats the password.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _identity_builders import BASE_IDENTITY
from _redis_secure_fixture import SecureRedis, make_tls_files, start_secure_redis
from kvbridge.connector.index import IndexNamespace, open_index
from kvbridge.connector.index.node_directory import NodeAddress
from kvbridge.kvmanager.kv_events import BlockStored

pytestmark = pytest.mark.timeout(60)

PASSWORD = "pa:ss/w@rd-0123"  # URL-special characters, percent-encoded in the URL
_NS = IndexNamespace(identity=BASE_IDENTITY)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvbridge-redis-secure-") as tmp:
        yield Path(tmp)


@pytest.fixture(scope="module")
def password_redis(workdir) -> Iterator[SecureRedis]:
    server = start_secure_redis(workdir, password=PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_redis(workdir) -> Iterator[SecureRedis]:
    server = start_secure_redis(workdir, password=PASSWORD, tls=make_tls_files(workdir))
    yield server
    server.stop()


def _hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(f"secure/{i}".encode()).digest() for i in range(n)]


def _publish_then_look_up(url: str) -> None:
    """Node a publishes 4 blocks and its address; node b finds all 4 and a's address."""
    index, directory = open_index(url, _NS)
    try:
        assert index.register_node("node-a", 7, ttl_s=30.0) == "ok"
        stored = BlockStored(
            block_hashes=_hashes(4), parent_block_hash=None, token_ids=[], block_size=16,
            lora_name=None, medium=None, group_id=0, block_ids=[11, 12, 13, 14],
        )
        index.publish("node-a", 7, [stored])
        hit = index.longest_prefix(_hashes(6), exclude_node_ids=["node-b"])
        assert hit.num_blocks == 4
        assert index.get_block_ids("node-a", 7, _hashes(4)) == [[11, 12, 13, 14]]
        directory.announce("node-a", NodeAddress("127.0.0.1", 7001, 7), ttl_s=30.0)
        assert directory.lookup("node-a") == NodeAddress("127.0.0.1", 7001, 7)
    finally:
        index.close()


def _assert_refused(url: str) -> None:
    index, _ = open_index(url, _NS)
    try:
        assert index.longest_prefix(_hashes(2)).num_blocks == 0  # no hit, no exception
        assert not index.available
        assert all(PASSWORD not in kind for kind in index.stats.errors_by_kind)
    finally:
        index.close()


def test_password_url_works_and_a_wrong_or_missing_password_is_no_hit(password_redis):
    _publish_then_look_up(password_redis.url)
    _assert_refused(password_redis.url.replace("pa%3Ass", "wrong"))
    _assert_refused(f"redis://127.0.0.1:{password_redis.port}/0")


def test_rediss_url_with_a_password_works_and_plain_tcp_to_it_is_no_hit(tls_redis):
    assert tls_redis.url.startswith("rediss://")
    _publish_then_look_up(tls_redis.url)
    _assert_refused(tls_redis.url.replace("rediss://", "redis://").split("?")[0])


def test_a_bad_index_url_error_does_not_repeat_the_password():
    with pytest.raises(ValueError) as excinfo:
        open_index(f"http://:{PASSWORD}@127.0.0.1:1/0", _NS)
    assert PASSWORD not in str(excinfo.value) and "http://" in str(excinfo.value)
