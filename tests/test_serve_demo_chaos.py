"""The main job's chaos run (issue 15, case 8): ``kvbridge-demo --chaos SEED`` with real
processes (Redis, a store node, P and D): P killed and restarted, P frozen, Redis and the store
killed and restarted while requests are in flight. Every request ends with the single-node
tokens or a clear error, no node leaks a block, and the faults come from the seed."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from kvbridge.connector.index.server_binary import find_server_binary
from kvbridge.connector.serve.demo import pd_pair
from kvbridge.connector.serve.demo.chaos import (
    FAULT_KINDS,
    ChaosClient,
    ChaosMonkey,
    error_kind,
    plan_faults,
)
from kvbridge.connector.serve.demo.processes import ProcessGroup
from kvbridge.connector.serve.proxy import HopError


def test_fault_plan_is_a_function_of_the_seed_and_has_every_kind():
    plan = plan_faults(7, num_requests=40, num_faults=6, kinds=FAULT_KINDS)
    assert plan == plan_faults(7, num_requests=40, num_faults=6, kinds=FAULT_KINDS)
    assert plan != plan_faults(8, num_requests=40, num_faults=6, kinds=FAULT_KINDS)
    assert {f.kind for f in plan} == set(FAULT_KINDS)  # 6 faults >= 4 kinds: each one once
    moments = [f.after_requests for f in plan]
    assert moments == sorted(moments)
    assert all(4 <= m <= 32 for m in moments)  # inside 10 %..80 % of the 40 requests
    assert all(0.2 <= f.down_s < 1.5 for f in plan)
    with pytest.raises(ValueError, match="at least 2 requests"):
        plan_faults(7, num_requests=1, num_faults=1, kinds=FAULT_KINDS)


def test_error_kind_names_a_hop_error_by_its_status_and_any_other_by_its_type():
    assert error_kind("HopError: 502: {'error': {'message': 'P down'}}") == "HopError 502"
    assert error_kind("HopError: 500: {'error': {'message': 'load failed'}}") == "HopError 500"
    assert error_kind("HopError: no status") == "HopError"
    assert error_kind("ReadTimeout: timed out") == "ReadTimeout"
    assert error_kind("decode finished with 'error'") == "decode finished with 'error'"


class _FlakyRouter:
    """Answers the queued statuses in turn (an int raises HopError with it), then "ok"."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.calls = 0

    async def complete(self, body):
        self.calls += 1
        if self.statuses:
            raise HopError(self.statuses.pop(0), {"error": {"message": "down"}})
        return "ok"


def test_chaos_client_retries_an_unreachable_hop_only_and_counts_the_request_once(tmp_path):
    monkey = ChaosMonkey(ProcessGroup(tmp_path), [], {})
    client = ChaosClient(_FlakyRouter([502, 503, 502]), monkey, attempts=4, backoff_s=0.0)
    assert asyncio.run(client.complete({})) == "ok"
    assert (client.retries, client.router.calls, monkey.sent) == (3, 4, 1)
    # Out of attempts: the last error is the request's.
    client = ChaosClient(_FlakyRouter([502] * 4), monkey, attempts=4, backoff_s=0.0)
    with pytest.raises(HopError) as info:
        asyncio.run(client.complete({}))
    assert info.value.status == 502 and client.router.calls == 4
    # A refusal (400) or D's 500 is final at once.
    for status in (400, 500):
        client = ChaosClient(_FlakyRouter([status]), monkey, attempts=4, backoff_s=0.0)
        with pytest.raises(HopError):
            asyncio.run(client.complete({}))
        assert client.router.calls == 1 and client.retries == 0


def test_chaos_run_every_request_correct_or_a_clear_error_and_no_block_leaked(capsys, tmp_path):
    # 8 conversations x 3 turns = 24 requests, 4 faults: one of each kind (with a Redis).
    argv = [
        "--no-progress", "--model", "tiny", "--store", "--num-blocks", "512",
        "--conversations", "8", "--turns", "3", "--load-timeout-s", "4",
        "--chaos", "3", "--chaos-faults", "4", "--workdir", str(tmp_path),
    ]
    code = pd_pair.run(pd_pair.parse_args(argv))
    out, err = capsys.readouterr()
    report = json.loads(out.splitlines()[-1])
    chaos = report["chaos"]
    assert code == 0, err[-3000:]
    kinds = set(FAULT_KINDS) if find_server_binary() is not None else set(FAULT_KINDS) - {
        "kill:redis"}
    assert chaos["faults_planned"] == chaos["faults_injected"] == 4
    assert set(chaos["faults_by_kind"]) == kinds
    assert chaos["fault_errors"] == [] and chaos["dead_nodes"] == []
    assert chaos["requests"] == 24
    assert chaos["wrong"] == 0 and report["mismatches"] == 0
    assert chaos["completed"] + chaos["failed"] == chaos["requests"]
    assert chaos["completed"] > 0
    # Every failure is the proxy naming the hop and its 5xx status, never a silent empty answer
    # (``errors_by_kind`` counts the error of every failed request; ``first_errors`` shows 5).
    assert sum(chaos["errors_by_kind"].values()) == chaos["failed"]
    assert all(re.fullmatch(r"HopError 5\d\d", kind) for kind in chaos["errors_by_kind"]), (
        chaos["errors_by_kind"], chaos["first_errors"])
    for error in chaos["first_errors"]:
        assert error.startswith("HopError: 5"), error
    # Both nodes drained: schedulers empty, every usable block free (pd_chaos.wait_drained).
    assert chaos["leaks"] == []
    # The restarted children kept their ports: their logs are kept next to the first ones.
    restarted = {f["kind"].split(":")[1] for f in chaos["faults"] if f["kind"].startswith("kill")}
    for name in restarted:
        assert (tmp_path / f"{name}.restart1.log").is_file()


@pytest.mark.skipif(find_server_binary() is None, reason="no Redis-protocol server binary")
def test_restart_keeps_argv_url_and_name_and_replaces_the_child(tmp_path):
    group = ProcessGroup(tmp_path)
    try:
        first = group.start_redis()
        second = group.restart(first)
        assert not first.running
        group.wait_redis(second)  # answers PING on the same port
        assert (second.name, second.url, second.argv, second.restarts) == (
            first.name, first.url, first.argv, 1)
        assert group.children == [second]
        assert (tmp_path / "redis.restart1.log").is_file()
    finally:
        group.stop_all()
