"""Faults for the main job's chaos run (``kvbridge-demo --chaos SEED``): a plan of faults
drawn from the seed, a thread that injects them into the running processes, a client that
retries requests a dead node could not answer, and the end-of-run leak check.

Faults (``plan_faults``), each at a moment counted in requests sent, so that a seed gives the
same plan and the same interleaving with the workload on a fast or a slow machine:

- ``kill:prefill``: SIGKILL the prefill node, wait ``down_s``, start it again with the same
  argv (same HTTP port and ``--engine-id``; the new process has a new incarnation, so a ticket
  of the old one is refused at the pull handshake and D follows its ``load_failure_policy``).
- ``freeze:prefill``: SIGSTOP the prefill node for ``down_s``, then SIGCONT (a stalled holder:
  D's pulls wait, up to ``load_timeout_s``).
- ``kill:redis``: SIGKILL the Redis server, wait, start it again on the same port (empty: no
  persistence); the nodes' index clients ride it out and reconnect.
- ``kill:store``: SIGKILL the store node, wait, start it again (same ports and engine id; empty).

Requests in flight to a killed P, or sent while it is down, fail at the proxy hop with a
``HopError`` 502 naming P's URL. :class:`ChaosClient` retries a request whose hop got 502 or
503 (a node unreachable, or one whose engine loop stopped) up to ``attempts`` times with
doubling backoff; whatever still fails is counted as failed with its error. Any other error
(a 4xx, a 500 from D) is final at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from ..proxy import HopError
from .processes import ManagedProcess, ProcessGroup, StartupError, free_port

__all__ = [
    "ChaosClient", "ChaosMonkey", "ChaosRun", "Fault", "chaos_node_args", "error_kind",
    "plan_faults", "wait_drained",
]

FAULT_KINDS = ("kill:prefill", "freeze:prefill", "kill:redis", "kill:store")
_RETRY_STATUSES = (502, 503)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: ``kind`` (``action:target``, one of ``FAULT_KINDS``) injected once
    ``after_requests`` requests have been sent; the target stays dead or frozen ``down_s``."""

    after_requests: int
    kind: str
    down_s: float


def error_kind(error: str) -> str:
    """The kind a failed request's error is counted under in the report: ``"HopError 502"``
    for a proxy hop that failed with a status (``"HopError: 502: {...}"``), else the text before
    the first ``": "`` (an exception's type name), or the whole error when it has none (``"decode
    finished with 'error'"``)."""
    head, sep, rest = error.partition(": ")
    if not sep:
        return error
    if head == "HopError":
        status = rest.partition(":")[0]
        if status.isdigit():
            return f"HopError {status}"
    return head


def plan_faults(
    seed: int, *, num_requests: int, num_faults: int, kinds: tuple[str, ...]
) -> list[Fault]:
    """``num_faults`` faults drawn from ``seed``: moments uniform in the first 80 % of the
    ``num_requests`` requests (sorted), kinds a seeded shuffle of ``kinds`` first (so a plan of
    at least ``len(kinds)`` faults has each kind), then uniform; ``down_s`` in [0.2, 1.5).

    Raises:
        ValueError: no kinds, or fewer than 2 requests to place faults between.
    """
    if not kinds:
        raise ValueError("no fault kinds to draw from")
    if num_requests < 2:
        raise ValueError(f"a chaos run needs at least 2 requests, got {num_requests}")
    rng = random.Random(seed)
    low, high = max(1, num_requests // 10), max(1, num_requests * 8 // 10)
    moments = sorted(rng.randint(low, high) for _ in range(num_faults))
    order = list(kinds)
    rng.shuffle(order)
    chosen = [order[i] if i < len(order) else rng.choice(kinds) for i in range(num_faults)]
    return [
        Fault(after_requests=m, kind=k, down_s=round(rng.uniform(0.2, 1.5), 2))
        for m, k in zip(moments, chosen, strict=True)
    ]


class ChaosMonkey:
    """Injects a fault plan into a ``ProcessGroup``'s children from its own thread.

    ``targets`` maps ``"prefill"``, ``"redis"``, ``"store"`` to the running child; a restart
    replaces the entry (read it back after :meth:`stop`). The workload calls
    :meth:`before_send` before each request (event-loop thread): it counts the request and,
    when a fault is due, waits until the fault has begun, so every planned fault lands while
    requests are in flight.

    Attributes:
        injected: one dict per fault that was injected: the fault, ``recovered_s`` (from the
            kill or freeze until the target answered again), ``requests_sent`` when it began.
        errors: a target that did not come back (the thread then stops injecting).
    """

    def __init__(
        self, group: ProcessGroup, faults: list[Fault], targets: dict[str, ManagedProcess]
    ) -> None:
        self.group = group
        self.faults = faults
        self.targets = dict(targets)
        self.injected: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.sent = 0
        self._begun = 0  # faults begun (written by the monkey thread only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-monkey", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 180.0) -> None:
        """Inject nothing more; wait for the fault in progress to finish (its restart)."""
        self._stop.set()
        self._thread.join(timeout_s)

    async def before_send(self) -> None:
        self.sent += 1
        while (
            self._begun < len(self.faults)
            and self.faults[self._begun].after_requests <= self.sent
            and self._thread.is_alive()
        ):
            await asyncio.sleep(0.02)

    def _run(self) -> None:
        for index, fault in enumerate(self.faults):
            while self.sent < fault.after_requests:
                if self._stop.wait(0.02):
                    return
            if self._stop.is_set():
                return
            sent = self.sent
            self._begun = index + 1
            start = time.monotonic()
            try:
                self._inject(fault)
            except (StartupError, OSError, KeyError) as exc:
                self.errors.append(f"{fault.kind} after {sent} requests: {exc}"[:800])
                return
            self.injected.append(
                {**asdict(fault), "requests_sent": sent,
                 "recovered_s": round(time.monotonic() - start, 2)}
            )

    def _inject(self, fault: Fault) -> None:
        action, name = fault.kind.split(":")
        target = self.targets[name]
        if action == "freeze":
            os.kill(target.popen.pid, signal.SIGSTOP)
            try:
                time.sleep(fault.down_s)
            finally:
                os.kill(target.popen.pid, signal.SIGCONT)
            return
        target.kill()
        time.sleep(fault.down_s)
        new = self.group.restart(target)
        self.targets[name] = new
        if name == "redis":
            self.group.wait_redis(new)
        else:
            self.group.wait_healthy([new])


class ChaosClient:
    """A ``PDRouter`` stand-in for kvbridge-demo's workload: counts each request with
    the monkey, then retries a hop that got 502/503 (see the module docstring).

    Attributes:
        retries: hops retried in all.
    """

    def __init__(self, router: Any, monkey: ChaosMonkey, *, attempts: int = 4,
                 backoff_s: float = 1.0) -> None:
        self.router = router
        self.monkey = monkey
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.retries = 0

    async def complete(self, body: dict[str, Any]) -> Any:
        """``PDRouter.complete`` with retries. Raises what the last attempt raised."""
        await self.monkey.before_send()
        for attempt in range(self.attempts):
            try:
                return await self.router.complete(body)
            except HopError as exc:
                if exc.status not in _RETRY_STATUSES or attempt + 1 == self.attempts:
                    raise
            except httpx.HTTPError:
                if attempt + 1 == self.attempts:
                    raise
            self.retries += 1
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")


def wait_drained(
    urls: dict[str, str], timeout_s: float
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Poll each node's ``/v1/stats`` until its scheduler is empty (nothing running, waiting
    or held for a peer) and every usable block is free, or ``timeout_s`` runs out.

    Args:
        urls: node name -> base URL (prefill and decode nodes; the store has no scheduler).

    Returns:
        ``(last stats per node, leaks)``: ``leaks`` is empty when every node drained, else one
        line per node that did not (its queues and free block count).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, dict[str, Any]] = {}
        leaks: list[str] = []
        for name, url in urls.items():
            try:
                stats[name] = httpx.get(f"{url}/v1/stats", timeout=10.0).json()
            except httpx.HTTPError as exc:
                leaks.append(f"{name}: /v1/stats unreachable ({exc!r})")
                continue
            c = stats[name]["counters"]
            if not c.get("scheduler_empty") or c["num_free_blocks"] != c["num_usable_blocks"]:
                leaks.append(
                    f"{name}: {c['num_running_reqs']} running, {c['num_waiting_reqs']} waiting, "
                    f"{c['num_held_reqs']} held, {c['num_free_blocks']} of "
                    f"{c['num_usable_blocks']} blocks free"
                )
        if not leaks or time.monotonic() > deadline:
            return stats, leaks
        time.sleep(0.5)


def chaos_node_args(args: Any, name: str) -> list[str]:
    """Extra node_server arguments for a chaos run (none otherwise): a fixed ``--engine-id``
    (a restart keeps it) and, for the store, a fixed write port (P and D keep its
    ``store_url``)."""
    if getattr(args, "chaos", None) is None:
        return []
    extra = ["--engine-id", f"chaos-{name}"]
    if name == "store":
        extra += ["--store-write-port", str(free_port())]
    return extra


class ChaosRun:
    """The chaos side of one kvbridge-demo run: plans the faults from ``args.chaos``,
    injects them (``wrap`` hands the workload its client), then :meth:`finish` checks the
    drain and :meth:`report` gives the figures.

    Args:
        args: pd_pair's arguments (``chaos``, ``chaos_faults``).
        children: the nodes and the Redis child (None when pd_pair started none); the ones
            named ``prefill``, ``redis`` and ``store`` are fault targets.
        num_requests: requests the workload will send (where the faults are placed).
    """

    def __init__(self, args: Any, group: ProcessGroup,
                 children: list[ManagedProcess | None], *, num_requests: int) -> None:
        targets = {
            c.name: c for c in children if c is not None and c.name in ("prefill", "redis", "store")
        }
        kinds = tuple(k for k in FAULT_KINDS if k.split(":")[1] in targets)
        self.seed = int(args.chaos)
        self.faults = plan_faults(self.seed, num_requests=num_requests,
                                  num_faults=args.chaos_faults, kinds=kinds)
        self.monkey = ChaosMonkey(group, self.faults, targets)
        self.client: ChaosClient | None = None
        self.leaks: list[str] = []
        self.dead: list[str] = []
        self.monkey.start()

    def wrap(self, router: Any) -> ChaosClient:
        self.client = ChaosClient(router, self.monkey)
        return self.client

    def finish(self, nodes: list[ManagedProcess], *, drain_timeout_s: float
               ) -> list[ManagedProcess]:
        """Stop injecting, wait for P and D to drain; returns ``nodes`` with restarted
        children in place of the killed ones."""
        self.monkey.stop()
        nodes = [self.monkey.targets.get(n.name, n) for n in nodes]
        self.dead = [f"{n.name} exited ({n.popen.returncode})" for n in nodes if not n.running]
        _, self.leaks = wait_drained(
            {n.name: n.url for n in nodes if n.name in ("prefill", "decode") and n.url},
            drain_timeout_s,
        )
        return nodes

    @property
    def clean(self) -> bool:
        """No leak, no dead node, every target came back (wrong tokens are checked apart)."""
        return not (self.leaks or self.dead or self.monkey.errors)

    def report(self, completed: list[Any], errors: list[str], wrong: int) -> dict[str, Any]:
        """The chaos figures (printed, and returned for the JSON report)."""
        kinds: dict[str, int] = {}
        for fault in self.monkey.injected:
            kinds[fault["kind"]] = kinds.get(fault["kind"], 0) + 1
        errors_by_kind: dict[str, int] = {}
        for error in errors:
            kind = error_kind(error)
            errors_by_kind[kind] = errors_by_kind.get(kind, 0) + 1
        out = {
            "seed": self.seed,
            "requests": self.monkey.sent,
            "faults_planned": len(self.faults),
            "faults_injected": len(self.monkey.injected),
            "faults_by_kind": kinds,
            "completed": len(completed) - wrong,
            "failed": len(errors),
            "wrong": wrong,
            "retries": self.client.retries if self.client is not None else 0,
            "leaks": self.leaks,
            "dead_nodes": self.dead,
            "fault_errors": self.monkey.errors,
            "faults": self.monkey.injected,
            "errors_by_kind": errors_by_kind,  # every failed request's error, counted
            "first_errors": errors[:5],
        }
        print(
            f"chaos seed {self.seed}: requests {out['requests']}, faults injected "
            f"{out['faults_injected']} of {out['faults_planned']} {kinds}, completed "
            f"{out['completed']}, failed {out['failed']}, wrong {wrong}, retries "
            f"{out['retries']}, leaks {len(self.leaks)}"
        )
        for line in [*self.leaks, *self.dead, *self.monkey.errors]:
            print(f"CHAOS: {line}", file=sys.stderr)
        return out
