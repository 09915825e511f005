"""IPv6 in every address kvbridge takes or hands out (issue 28, item 2): one parser of hosts and
``host:port`` (``kvbridge.transport.address``) behind ``store_url``, ``index_url`` (one server
or cluster seeds), ``host``, tickets' ``remote_host``, the node directory and the proxy's node
URLs. An IPv6 address is bare where the host is a field of its own and in brackets where a port
follows it; whatever is ambiguous is refused at start, in one line that shows the form.

The tests that run something over ``[::1]`` (a Redis server and a Redis Cluster bound to ``::1``
alone) skip, naming why, where the host has no IPv6 loopback (``_ipv6``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx
import msgpack
import pytest
import redis
from _ipv6 import require_ipv6_loopback
from _redis_cluster_fixture import RedisClusterServers
from _redis_fixture import server_binary
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbridge.connector.config import KVTransferConfig
from kvbridge.connector.errors import KVTransferConfigError, KVTransferParamsError
from kvbridge.connector.index import (
    IndexNamespace,
    InMemoryNodeDirectory,
    NodeAddress,
    RedisNodeDirectory,
    open_index,
)
from kvbridge.connector.index.url import parse_cluster_url
from kvbridge.connector.metadata import Ticket
from kvbridge.connector.serve import proxy
from kvbridge.connector.serve.node import server as node_server
from kvbridge.connector.store import parse_store_url
from kvbridge.connector.transfer_params import (
    RemotePrefillParams,
    release_notices_for_rejected,
    ticket_of,
)
from kvbridge.transport import (
    BlockIdentity,
    HostPort,
    check_host,
    format_host_port,
    parse_base_url,
    parse_host_port,
)

NAMESPACE = IndexNamespace(identity=BlockIdentity(model_name="ipv6", kv_cache_dtype="float32",
                                                  block_size=16, hash_fn_name="sha256_cbor"))

# ---------------------------------------------------------------------- the parser
# Each is its own canonical form: format_host_port(*parse_host_port(x)) gives x back.
GOOD_HOST_PORTS = [
    ("127.0.0.1:7600", HostPort("127.0.0.1", 7600)),
    ("10.1.2.3:1", HostPort("10.1.2.3", 1)),
    ("localhost:65535", HostPort("localhost", 65535)),
    ("store-0.kv.svc.cluster.local:7600", HostPort("store-0.kv.svc.cluster.local", 7600)),
    ("my_service:80", HostPort("my_service", 80)),  # compose / k8s names may hold "_"
    ("[::1]:7600", HostPort("::1", 7600)),
    ("[::]:7600", HostPort("::", 7600)),
    ("[2001:db8::7]:6379", HostPort("2001:db8::7", 6379)),
    ("[fd00::2]:1", HostPort("fd00::2", 1)),
    ("[::ffff:10.0.0.1]:80", HostPort("::ffff:10.0.0.1", 80)),  # IPv4-mapped
]
# (text, the reason the one-line error gives)
BAD_HOST_PORTS = [
    ("::1:7600", "an IPv6 address takes brackets"),  # [::1]:7600 or [::1:7600]?
    ("2001:db8::7:6379", "an IPv6 address takes brackets"),
    ("::1", "an IPv6 address takes brackets"),
    ("[fe80::1%eth0]:7600", "zone ids"),
    ("[::1]", "no port"),
    ("localhost", "no port"),
    ("[::1]:", "port must be in [1, 65535], got ''"),
    ("[::1]:0", "port must be in [1, 65535], got '0'"),
    ("h:65536", "port must be in [1, 65535], got '65536'"),
    ("h:-1", "port must be in [1, 65535], got '-1'"),
    ("h:80x", "port must be in [1, 65535], got '80x'"),
    ("h:٣", "port must be in [1, 65535], got '٣'"),  # a digit to str.isdigit, not to us
    ("", "empty host"),
    (":7600", "empty host"),
    ("[]:7600", "brackets hold an IPv6 address only"),
    ("[10.0.0.1]:80", "brackets hold an IPv6 address only"),
    ("[::1:7600", "no closing bracket"),
    ("[::1]7600", "'7600' after the closing bracket"),
    ("[::g]:80", "not an IPv6 address"),
    ("10.0.0.256:80", "not an IPv4 address"),
    ("no such host:80", "not a hostname"),
    ("-h:80", "not a hostname"),
    ("user@h:80", "not a hostname"),
]


@pytest.mark.parametrize(("text", "expected"), GOOD_HOST_PORTS)
def test_host_port_parses_and_formats_back(text, expected):
    assert parse_host_port(text, what="store_url") == expected
    assert format_host_port(*expected) == text


@pytest.mark.parametrize(("text", "reason"), BAD_HOST_PORTS)
def test_ambiguous_or_malformed_host_port_is_refused_in_one_line(text, reason):
    with pytest.raises(ValueError) as info:
        parse_host_port(text, what="store_url")
    message = str(info.value)
    assert message.startswith(f"store_url must be 'host:port' or '[ipv6]:port', got {text!r} (")
    assert reason in message and "\n" not in message


def test_a_default_port_fills_only_a_missing_one():
    assert parse_host_port("[::1]", what="x", default_port=6379) == ("::1", 6379)
    assert parse_host_port("h", what="x", default_port=6379) == ("h", 6379)
    assert parse_host_port("[::1]:7000", what="x", default_port=6379) == ("::1", 7000)
    with pytest.raises(ValueError, match=r"^x must be 'host\[:port\]' or '\[ipv6\]\[:port\]'"):
        parse_host_port("::1", what="x", default_port=6379)  # still ambiguous


@settings(max_examples=200, deadline=None)
@given(
    address=st.ip_addresses(),
    port=st.integers(1, 65535),
)
def test_every_ip_address_round_trips(address, port):
    host = str(address)
    text = format_host_port(host, port)
    assert text.startswith("[") == (address.version == 6)
    assert parse_host_port(text, what="x") == (host, port)
    assert check_host(host, what="host") == host


@pytest.mark.parametrize("host", ["::1", "fd00::2", "127.0.0.1", "node-1", "::ffff:1.2.3.4"])
def test_a_host_standing_alone_is_bare(host):
    assert check_host(host, what="host") == host


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("[::1]", "no brackets around an address that stands alone"),
        ("fe80::1%eth0", "zone ids"),
        ("", "empty host"),
        ("::1:7600:", "not an IPv6 address"),
        ("host:80", "not an IPv6 address"),  # a port has a field of its own
        ("1.2.3", "not an IPv4 address"),
        ("a b", "not a hostname"),
    ],
)
def test_a_host_standing_alone_refuses_brackets_ports_and_junk(host, reason):
    with pytest.raises(ValueError) as info:
        check_host(host, what="remote_host")
    assert str(info.value).startswith("remote_host must be a hostname or an IP address")
    assert reason in str(info.value)


# ---------------------------------------------------------------------- configuration
def _config(**extra) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_both", "kv_connector_extra_config": extra})


def test_store_url_reads_a_bracketed_ipv6_address():
    assert parse_store_url("[::1]:7600") == ("::1", 7600)  # before: host "[::1]"
    assert parse_store_url("127.0.0.1:7600") == ("127.0.0.1", 7600)


@pytest.mark.parametrize(
    "extra",
    [
        {"host": "::1"},
        {"host": "fd00::2", "store_url": "[fd00::2]:7600", "offload": "evict",
         "index_url": "redis://[fd00::2]:6379/0"},
        {"index_url": "redis://:secret@[::1]:6379/0"},
        {"index_url": "rediss://[::1]/0"},
        {"index_url": "redis-cluster://[::1]:7000,[::1]:7001,10.0.0.3:7002?buckets=8"},
        {"index_url": "unix:///run/redis.sock?db=0"},
        {"index_url": "memory"},
    ],
)
def test_config_takes_ipv6_in_every_address(extra):
    config = _config(**extra)
    assert {key: getattr(config, key) for key in extra} == extra


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"store_url": "::1:7600"},
         "store_url must be 'host:port' or '[ipv6]:port', got '::1:7600' (an IPv6 address "
         "takes brackets, as in '[::1]:7600')"),
        ({"store_url": "[::1]:99999"},
         "store_url must be 'host:port' or '[ipv6]:port', got '[::1]:99999' (port must be in "
         "[1, 65535], got '99999')"),
        ({"store_url": ":7600"},
         "store_url must be 'host:port' or '[ipv6]:port', got ':7600' (empty host)"),
        ({"index_url": "redis://::1:6379/0"},
         "index_url must be 'redis://host[:port]/db' or 'redis://[ipv6][:port]/db', got "
         "'redis://::1:6379/0' (an IPv6 address takes brackets, as in '[::1]:7600')"),
        ({"index_url": "redis://:hunter2hunter2@::1:6379/0"},  # the password is never shown
         "index_url must be 'redis://host[:port]/db' or 'redis://[ipv6][:port]/db', got "
         "'redis://:***@::1:6379/0' (an IPv6 address takes brackets, as in '[::1]:7600')"),
        ({"index_url": "redis:///0"},
         "index_url must be 'redis://host[:port]/db' or 'redis://[ipv6][:port]/db', got "
         "'redis:///0' (empty host)"),
        ({"index_url": "redis-cluster://[::1]:7000,::1:7001"},
         "index_url must be 'redis-cluster://HOST:PORT[,HOST:PORT...]' ('[IPV6]:PORT' for "
         "IPv6), got 'redis-cluster://[::1]:7000,::1:7001' (seed '::1:7001': an IPv6 address "
         "takes brackets, as in '[::1]:7600')"),
        ({"index_url": "http://[::1]:6379"},
         "index_url must be 'memory', 'redis://host[:port]/db', 'redis://[ipv6][:port]/db' "
         "(or rediss://), 'unix:///path' or 'redis-cluster://host:port[,host:port...]', got "
         "'http://[::1]:6379'"),
        ({"host": "[::1]"},
         "host must be a hostname or an IP address (IPv6 without brackets, e.g. '::1'), got "
         "'[::1]' (no brackets around an address that stands alone)"),
    ],
)
def test_config_refuses_an_ambiguous_address_at_start_in_one_line(extra, message):
    with pytest.raises(KVTransferConfigError) as info:
        _config(**extra)
    assert str(info.value) == message


def test_cluster_seeds_keep_their_ipv6_hosts_bare():
    seeds, num_buckets = parse_cluster_url("redis-cluster://[::1]:7000,[::1]:7001?buckets=4")
    assert (seeds, num_buckets) == ([("::1", 7000), ("::1", 7001)], 4)


# ---------------------------------------------------------------------- tickets
def _ticket_params(host: str) -> RemotePrefillParams:
    return RemotePrefillParams(
        remote_engine_id="p0", remote_incarnation="i0", remote_request_id="p-req",
        remote_host=host, remote_port=7600, remote_block_ids=((1, 2, 3),),
        remote_num_tokens=40, remote_block_size=16, lease_expires_at=1e9,
        remote_lease_token="tok",
    )


@pytest.mark.parametrize("host", ["::1", "2001:db8::7", "127.0.0.1", "prefill-0"])
def test_a_ticket_with_an_ipv6_host_round_trips_through_kv_transfer_params(host):
    params = _ticket_params(host)
    on_the_wire = json.loads(json.dumps(params.to_dict()))  # through the proxy, as JSON
    parsed = RemotePrefillParams.parse(on_the_wire, num_groups=1, block_size=16)
    assert parsed == params
    assert ticket_of(parsed) == Ticket(host, 7600, "p-req", "tok")  # bare: port is its own field
    (notice,) = release_notices_for_rejected(on_the_wire, "refused")
    assert notice is not None and (notice.ticket.host, notice.ticket.port) == (host, 7600)


@pytest.mark.parametrize("host", ["[::1]", "fe80::1%eth0", "::1:7600:", "no host", "10.0.0.256"])
def test_a_ticket_whose_remote_host_is_no_host_is_refused_by_name(host):
    on_the_wire = _ticket_params("::1").to_dict() | {"remote_host": host}
    with pytest.raises(KVTransferParamsError) as info:
        RemotePrefillParams.parse(on_the_wire, num_groups=1, block_size=16)
    assert info.value.field == "remote_host" and repr(host) in str(info.value)
    assert release_notices_for_rejected(on_the_wire, "refused") == []  # no notice to junk


# ---------------------------------------------------------------------- node directory
def test_the_in_memory_directory_keeps_an_ipv6_host_and_refuses_a_bracketed_one():
    directory = InMemoryNodeDirectory()
    directory.announce("p0", NodeAddress("::1", 7600, 3), ttl_s=30.0)
    assert directory.lookup("p0") == NodeAddress("::1", 7600, 3)
    with pytest.raises(ValueError, match="node address host must be"):
        directory.announce("p1", NodeAddress("[::1]", 7600, 3), ttl_s=30.0)


def test_redis_over_ipv6_keeps_ipv6_addresses_and_skips_garbage(redis_url_ipv6):
    assert redis_url_ipv6.startswith("redis://[::1]:")  # the server listens on ::1 alone
    index, directory = open_index(redis_url_ipv6, NAMESPACE)  # redis-py's from_url over ::1
    try:
        assert isinstance(directory, RedisNodeDirectory)
        assert index.register_node("p0", 3, ttl_s=30.0) == "ok"
        directory.announce("p0", NodeAddress("::1", 7600, 3), ttl_s=30.0)
        assert directory.lookup("p0") == NodeAddress("::1", 7600, 3)
        # An entry another writer left with a host no transport can dial is garbage, skipped.
        raw = redis.Redis.from_url(redis_url_ipv6)
        for host in ("[::1]", "::1:7600:", ""):
            raw.set(f"{NAMESPACE.key_prefix}:addr:bad", msgpack.packb([host, 7600, 3]))
            assert directory.lookup("bad") is None, host
        raw.close()
    finally:
        index.close()


@pytest.fixture(scope="module")
def ipv6_cluster():
    require_ipv6_loopback()
    with tempfile.TemporaryDirectory(prefix="kvbridge-cluster6-") as tmp:
        servers = RedisClusterServers(server_binary().path, Path(tmp), host="::1")
        try:
            servers.start_all()
            yield servers
        finally:
            servers.stop_all()


def test_a_cluster_index_on_ipv6_seeds_registers_and_keeps_ipv6_addresses(ipv6_cluster):
    url = ipv6_cluster.url
    assert url.startswith("redis-cluster://[::1]:") and url.count("[::1]:") == 3
    index, directory = open_index(url, NAMESPACE)
    try:
        assert index.register_node("p0", 3, ttl_s=30.0) == "ok"  # every bucket, every shard
        directory.announce("p0", NodeAddress("::1", 7600, 3), ttl_s=30.0)
        assert directory.lookup("p0") == NodeAddress("::1", 7600, 3)
    finally:
        index.close()


# ---------------------------------------------------------------------- examples
async def test_the_proxy_reaches_ipv6_nodes_at_their_bracketed_urls():
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host} {request.url.port} {request.url}")
        if request.url.port == 8100:
            return httpx.Response(200, json={"choices": [{}], "kv_transfer_params": {"x": 1}})
        return httpx.Response(200, json={"choices": [{"token_ids": [7]}]})

    router = proxy.PDRouter(["http://[::1]:8100/"], ["http://[fd00::2]:8200"])
    assert (router.prefill_urls, router.decode_urls) == (
        ["http://[::1]:8100"], ["http://[fd00::2]:8200"]
    )
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    await router.complete({"prompt": [1, 2, 3], "max_tokens": 1})
    await router.aclose()
    assert seen == [
        "::1 8100 http://[::1]:8100/v1/completions",
        "fd00::2 8200 http://[fd00::2]:8200/v1/completions",
    ]


@pytest.mark.parametrize(
    ("prefill", "decode", "fragment"),
    [
        ("http://::1:8100", "http://[::1]:8200",
         "prefill URL must be 'http://host:port' or 'http://[ipv6]:port', got 'http://::1:8100'"),
        ("http://[::1]:8100", "[::1]:8200",
         "decode URL must be 'http://host:port' or 'http://[ipv6]:port', got '[::1]:8200'"),
        ("http://[::1]:0", "http://d", "port must be in [1, 65535], got '0'"),
    ],
)
def test_the_proxy_refuses_an_ambiguous_node_url(prefill, decode, fragment):
    with pytest.raises(ValueError) as info:
        proxy.PDRouter([prefill], [decode])
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_the_proxy_command_refuses_an_ambiguous_url_before_serving(monkeypatch, capsys):
    served = []
    monkeypatch.setattr(proxy, "serve_http", lambda *a, **kw: served.append(kw))
    with pytest.raises(SystemExit) as info:
        proxy.main(["--prefill", "http://::1:8100", "--decode", "http://[::1]:8200"])
    assert info.value.code == 2 and served == []
    (last,) = capsys.readouterr().err.strip().splitlines()  # one line: "PROG: error: ..."
    assert last.endswith(
        ": error: --prefill must be 'http://host:port' or 'http://[ipv6]:port', got "
        "'http://::1:8100' (an IPv6 address takes brackets, as in '[::1]:7600')"
    )
    assert proxy.main(["--prefill", "http://[::1]:8100", "--decode", "http://[::1]:8200",
                       "--host", "::1"]) == 0
    assert served[0]["host"] == "::1"


def test_a_node_listening_on_every_ipv6_address_advertises_ipv6_loopback():
    args = node_server.parse_args(["--role", "prefill", "--host", "::", "--index-url", "memory"])
    extra = node_server.kv_transfer_config_dict(args)["kv_connector_extra_config"]
    assert extra["host"] == "::1"  # as 0.0.0.0 advertises 127.0.0.1
    with pytest.raises(SystemExit):
        node_server.parse_args(["--host", "[::1]"])


def test_parse_base_url_keeps_the_url_as_given():
    assert parse_base_url("https://[2001:db8::7]/api/", what="x") == "https://[2001:db8::7]/api"
    assert parse_base_url("http://p", what="x") == "http://p"
