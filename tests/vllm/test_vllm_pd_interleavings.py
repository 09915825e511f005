"""The P/D handoff in vLLM's real ``Scheduler`` (and ``AsyncScheduler``) on CPU under random
interleavings (vLLM's unit-test style, no worker: ``_vllm_sched_builders``).

A seeded driver (``random.Random(seed)``) runs a prefill node P (``kv_producer`` or
``kv_both``) and a decode node D (``kv_consumer`` or ``kv_both``), each a real scheduler with
a small KV cache (63 usable blocks of 32 tokens: requests evict and preempt one another), and a
fake worker for each. It mixes:

- P requests (``do_remote_decode``) whose prompts share prefixes of random lengths (several
  prompt families, some prompts repeated), so both nodes get partial local prefix hits;
- P's tickets handed to D after a random delay, some never (P's lease must expire), some twice
  (a proxy's retry), some spoiled (malformed fields, with or without a usable address), some
  with another prompt (P's ticket for y on D's request x, one token apart), some for a prefix
  of D's prompt, some covering more than D's prompt;
- D's pulls settling 0-6 steps after they are planned: landed, failed whole, failed from some
  block on, or in random blocks; P's fake holder serves a block only by its hash (P still
  caches it) or, without one, under the live lease; the ``PullReport`` sometimes one report
  late; a request whose pull failed is often aborted right after;
- P's leases ending exactly once: by D's completion notice after its pull, by a release notice
  in D's orders, or by expiry (a random number of P steps);
- aborts on either node at random moments (queued, waiting for remote KV, running, preempted);
- under ``recompute`` or ``fail`` (per seed), sync or async scheduling (per node, per seed).

The fake workers keep a model of what each physical block holds (the prompt prefix whose KV
was written there, by a forward or a landed pull; a failed pull leaves garbage), so the main
check is end to end. After every step:

- every request scheduled on either node runs on blocks that hold its own prompt's KV over
  everything vLLM counts as computed (so D never runs on a failed pull's blocks, under any
  policy, nor on P's blocks of another prompt; after a failure under ``recompute`` the
  computed count never covers a failed block), and under ``fail`` a failed pull's request
  ends with an error before it runs;
- each pull plan pairs D's blocks with the ticket's P blocks by position, from D's local hit
  on, with D's own block hashes; its lease is the request's ticket;
- P grants exactly one lease per request it finished with a ticket (the ticket's token and
  blocks), holds those blocks untouched (same hashes, referenced) until the lease ends, and
  frees them then; every finished request P still keeps has a live lease;
- no D request waits for remote KV (or, aborted, holds blocks) without its pull in flight;
- D plans a pull for, or sends one release notice about, every ticket it admitted with a
  usable address: exactly once.

At the end (tickets delivered or dropped, pulls settled, leases ended): both schedulers empty,
every block free, the connectors' per-request state empty, and D's counters agree with the
reports (loads + failed loads == pull reports + tickets refused without a pull, blocks
received == the landed pulls' blocks, expired leases == P's expiries), and every ticket D was
told to heart-beat it was told to forget.

Each seed draws the policy, the roles, sync or async scheduling per node and D's
``load_mode`` (``auto``/``async``/``sync``; sync only without async scheduling, as
``load_modes`` allows). A sync pull settles before its step's forward and its failed blocks
come with that step's report (vLLM then cuts back, or fails, every request of the step holding
them: the forward of those is not checked, what it writes counts as garbage if it read any).

Found (reproducer below, ``xfail``): under ``load_mode`` "sync" and ``recompute``, a request
that hit a failing sync load's blocks in the same step keeps them as computed, relying on the
loading request to recompute them; if the loader is aborted first, it decodes over KV never
written (vLLM's ``_update_requests_with_invalid_blocks``). Since, ``"auto"`` (the default) loads
a handoff in its step under ``recompute`` only for a request alone in the engine
(``connector/vllm/load_modes.py``; ``test_vllm_scheduler_board.py``), and an explicit
``"sync"`` is warned about at start. The soak does not abort such a loader in the step after
its failure.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from _vllm_sched_builders import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_of,
    make_request,
    make_scheduler,
    model_runner_output,
    ticket_for,
    worker_report,
)
from kvbridge.connector.metadata import PullReport, decode_metadata
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.request import RequestStatus

SEEDS = range(40)
NUM_TICKS = 200
P_PORT, D_PORT = 47000, 47100
DO_REMOTE_DECODE = {"do_remote_decode": True}
# spoiled field -> whether D can still address P (a release notice goes out)
SPOILS = [
    ({"remote_block_ids": None}, True),  # one block too many (see ``add_d``)
    ({"remote_block_size": 16}, True),
    ({"remote_port": "47000"}, False),
    ({"remote_host": ""}, False),
]
GARBAGE = "garbage"  # what a failed pull leaves at a position of a block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Node:
    """One engine: its scheduler, the steps in flight, and what each block physically holds
    (``content[block_id][j]``: the identity of the prompt prefix whose last token's KV the
    block's position ``j`` holds, or ``GARBAGE``; prompt positions only)."""

    def __init__(self, soak: Soak, name: str, role: str, *, policy: str, async_scheduling: bool,
                 extra: dict | None = None) -> None:
        self.soak = soak
        self.name = name
        self.async_scheduling = async_scheduling
        self.scheduler = make_scheduler(role, engine_id=name, policy=policy, extra=extra,
                                        worker_port=P_PORT if name == "prefill" else D_PORT,
                                        async_scheduling=async_scheduling)
        self.connector = connector_of(self.scheduler)
        self.sched = self.connector._sched()
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.content: dict[int, list] = {}
        self.in_flight: deque = deque()  # (step, output, meta, partial ids)
        self.k = 0
        self.prompts: dict[str, tuple] = {}  # request id -> its prompt

    def where(self) -> str:
        return f"seed {self.soak.seed} {self.name} step {self.k}"

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def schedule(self, before_forward=None):
        """schedule(); ``before_forward(output, meta)``: what the worker does before the
        forward (sync pulls), returns the ids of requests whose forward may read blocks a
        failed sync load left (vLLM discards that output) and the step's extra answer."""
        self.k += 1
        output = self.scheduler.schedule()
        meta = decode_metadata(output.kv_connector_metadata.payload)
        tolerated = before_forward(output, meta) if before_forward else set()
        self.forward(output.num_scheduled_tokens, tolerated)
        requests = self.scheduler.requests
        for rid in output.preempted_req_ids or ():
            self.soak.counts[f"{self.name} preempted"] += 1
            self.soak.history[rid].append(("preempted", self.k))
        partial = [rid for rid in output.num_scheduled_tokens if rid in requests
                   and requests[rid].num_computed_tokens < requests[rid].num_tokens]
        self.in_flight.append((self.k, output, meta, partial))
        return output, meta

    def ids_of(self, request) -> list:
        """Each prompt position's identity: its token and everything before it (the KV a
        block holds at that position is right only for that prefix)."""
        prompt = tuple(request.prompt_token_ids)
        ids = self.soak.prefix_ids.get(prompt)
        if ids is None:
            ids, last = [], 0
            for token in prompt:
                last = hash((last, token))
                ids.append(last)
            self.soak.prefix_ids[prompt] = ids
        return ids

    def unsound_at(self, request, start: int) -> int | None:
        """The first position below ``start`` whose block does not hold ``request``'s KV."""
        ids = self.ids_of(request)
        table = self.block_ids(request.request_id)
        for i in range(cdiv(min(start, len(ids)), BLOCK_SIZE)):
            lo, hi = i * BLOCK_SIZE, min((i + 1) * BLOCK_SIZE, start, len(ids))
            held = self.content.get(table[i])
            if held is None or held[: hi - lo] != ids[lo:hi]:
                return i
        return None

    def write(self, request, start: int, end: int, sound: bool) -> None:
        ids = self.ids_of(request)
        table = self.block_ids(request.request_id)
        for pos in range(start, min(end, len(ids))):
            i, j = divmod(pos, BLOCK_SIZE)
            block = self.content.setdefault(table[i], [GARBAGE] * BLOCK_SIZE)
            block[j] = ids[pos] if sound else GARBAGE
            if self.soak.debug is not None and (j == 0 or pos == start):
                self.soak.debug[(self.name, table[i])].append(
                    (self.k, request.request_id, i, sound))

    def forward(self, scheduled: dict[str, int], tolerated: set[str]) -> None:
        """The step's forward: each layer writes every scheduled token's KV, then every
        request attends over its computed positions, which must hold its own prompt's KV
        (``tolerated``: requests a failed sync load hit, whose output vLLM discards; what
        they write is garbage when they read garbage, and others may read that)."""
        requests = self.scheduler.requests
        spans = {rid: (requests[rid], requests[rid].num_computed_tokens - num,
                       requests[rid].num_computed_tokens) for rid, num in scheduled.items()}
        for request, start, end in spans.values():
            self.write(request, start, end, True)
        garbage: set[str] = set()
        changed = True
        while changed:
            changed = False
            for rid in sorted(tolerated - garbage):
                request, start, end = spans[rid]
                if self.unsound_at(request, start) is not None:
                    garbage.add(rid)
                    self.write(request, start, end, False)
                    changed = True
        for rid, (request, start, _) in spans.items():
            if rid in tolerated:
                continue
            i = self.unsound_at(request, start)
            assert i is None, (self.where(), "runs on KV that is not its prompt's", rid, i,
                               self.block_ids(rid)[i], start, self.soak.history.get(rid))

    def step(self, make_kv, before_forward=None) -> tuple:
        """One schedule() and the reports of the steps then due (async: one step stays in
        flight while requests run). ``make_kv()``: the worker's connector answer for a report.
        Returns the finished requests' outputs."""
        out = self.schedule(before_forward)
        keep = 1 if self.async_scheduling and self.scheduler.requests else 0
        finished = {}
        while len(self.in_flight) > keep:
            finished.update(self.report(make_kv))
        return out, finished

    def report(self, make_kv) -> dict:
        _, output, _, partial = self.in_flight.popleft()
        runner_output = model_runner_output(output, **make_kv())
        for rid in partial:
            runner_output.sampled_token_ids[runner_output.req_id_to_index[rid]] = []
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        return {o.request_id: o for outs in engine_outputs.values() for o in outs.outputs
                if o.finish_reason is not None}


@dataclass
class Lease:
    request_id: str
    token: str
    block_ids: list[int]
    block_hashes: list[bytes]
    prompt: tuple
    expires_at: int  # P step
    ended: str = ""


@dataclass
class Pull:
    request_id: str
    plan: Any
    due: int  # D step whose report settles it
    mode: str
    token: str
    prompt: tuple  # P's prompt (the ticket's)


@dataclass
class DReq:
    request: Any
    token: str  # "" when D cannot address P
    kind: str  # good / spoiled / other / dup
    p_prompt: tuple
    failed_at: int | None = None  # first D block position a pull failed at
    failed_step: int = 0
    settled: bool = False
    planned: bool = False


class Soak:
    def __init__(self, seed: int, *, policy: str | None = None, p_async: bool | None = None,
                 d_async: bool | None = None, load_mode: str | None = None,
                 quiet: bool = False, debug: bool = False) -> None:
        self.rng = rng = random.Random(seed)
        self.seed = seed
        self.policy = policy or rng.choice(["recompute", "fail"])
        p_async = rng.random() < 0.4 if p_async is None else p_async
        d_async = rng.random() < 0.4 if d_async is None else d_async
        self.p = Node(self, "prefill", rng.choice(["kv_producer", "kv_producer", "kv_both"]),
                      policy="fail", async_scheduling=p_async, extra={"lease_s": 30.0})
        self.load_mode = load_mode or (
            "async" if d_async else rng.choice(["auto", "async", "sync"]))
        self.d = Node(self, "decode", rng.choice(["kv_consumer", "kv_consumer", "kv_both"]),
                      policy=self.policy, async_scheduling=d_async,
                      extra={"load_mode": self.load_mode})
        self.quiet = quiet  # a reproducer's: no random faults
        self.debug = defaultdict(list) if debug else None  # (node, block) -> its writes
        self.finishing = False  # the end of a run: every lease expires soon
        self.families = [[rng.randrange(3, 500) for _ in range(12 * BLOCK_SIZE)]
                         for _ in range(3)]
        self.earlier: list[list[int]] = []
        self.history: dict[str, list] = defaultdict(list)
        self.prefix_ids: dict[tuple, list] = {}
        # P
        self.p_tickets: dict[str, dict] = {}  # P request id -> its ticket, until granted
        self.leases: dict[str, Lease] = {}  # token -> lease
        self.ended: list[Lease] = []  # ended, not yet reported to P
        self.expired_unreported = 0
        self.sent: list[str] = []  # P request ids whose lease end this step reported
        self.handoffs: list[tuple[int, dict, tuple]] = []  # (due D step, ticket, P's prompt)
        # D
        self.dreqs: dict[str, DReq] = {}
        self.pulls: dict[str, Pull] = {}  # D request id -> its pull in flight
        self.late_reports: list[PullReport] = []
        self.abort_soon: list[str] = []  # D requests to abort before the next step
        self.reports_now: list[PullReport] = []  # settled, for the next report
        self.invalid_now: set[int] = set()  # sync pulls' failed blocks, for the step's report
        self.notices_due: list[tuple[int, Any]] = []  # (due P step, notice)
        self.expected_said: Counter = Counter()  # token -> D requests that must plan or notify
        self.said: Counter = Counter()  # token -> plans + notices D sent
        self.watched: Counter = Counter()  # token -> D's orders to heart-beat it
        self.forgotten: Counter = Counter()  # token -> D's orders to stop
        self.reports = 0
        self.refused_locally = 0
        self.landed_blocks = 0
        self.counts: Counter = Counter()

    # ------------------------------------------------------------------ workload
    def new_prompt(self) -> list[int]:
        rng = self.rng
        if self.earlier and rng.random() < 0.15:
            return list(rng.choice(self.earlier))
        family = rng.choice(self.families)
        shared = rng.randrange(0, len(family) + 1)
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 4 * BLOCK_SIZE))]
        prompt = (family[:shared] + tail)[: 11 * BLOCK_SIZE]
        self.earlier.append(prompt)
        return prompt

    def add_p(self, prompt: list[int] | None = None, max_tokens: int = 1):
        prompt = prompt or self.new_prompt()
        request = make_request(prompt, max_tokens=max_tokens,
                               kv_transfer_params=dict(DO_REMOTE_DECODE))
        self.p.prompts[request.request_id] = tuple(prompt)
        self.p.scheduler.add_request(request)
        self.counts["p requests"] += 1
        return request

    def add_d(self, ticket: dict, p_prompt: tuple, kind: str = "good",
              prompt: list[int] | None = None, max_tokens: int | None = None):
        rng = self.rng
        usable = True
        params = dict(ticket)
        if kind == "spoiled":
            spoil, usable = rng.choice(SPOILS)
            params.update(spoil)
            if "remote_block_ids" in spoil:
                params["remote_block_ids"] = [[*ticket["remote_block_ids"][0], 41]]
        if prompt is None:
            prompt = list(p_prompt)
            if kind == "other":  # another prompt's ticket: one token differs (often the tail)
                last = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
                i = rng.randrange(last if rng.random() < 0.7 else 0, len(prompt))
                prompt[i] = 3 + (prompt[i] - 2) % 497
            elif kind == "longer":  # P computed a prefix of D's prompt
                prompt += [rng.randrange(3, 500) for _ in range(rng.randrange(1, 80))]
            elif kind == "shorter":  # the ticket covers more than D's prompt: refused
                prompt = prompt[: rng.randrange(1, len(prompt))]
        request = make_request(prompt, max_tokens=max_tokens or rng.choice([1, 2, 4, 16, 64]),
                               kv_transfer_params=params)
        token = ticket["remote_lease_token"] if usable else ""
        if token:
            self.expected_said[token] += 1
        self.dreqs[request.request_id] = DReq(request, token, kind, p_prompt)
        self.d.prompts[request.request_id] = tuple(prompt)
        self.d.scheduler.add_request(request)
        self.counts[f"d {kind}"] += 1
        return request

    def sharers_at_risk(self, rid: str) -> bool:
        """Aborting ``rid`` now would hit the known vLLM/kvbridge defect reproduced by
        ``test_sync_load_failure_then_abort_leaves_a_sharer_on_unwritten_kv``: its sync load
        failed in the last step under ``recompute`` (another request may count on it to
        recompute the blocks they share)."""
        dreq = self.dreqs.get(rid)
        return (self.load_mode == "sync" and self.policy == "recompute" and dreq is not None
                and dreq.failed_at is not None and dreq.failed_step == self.d.k)

    def abort(self, node: Node) -> None:
        live = [rid for rid, r in node.scheduler.requests.items()
                if not r.is_finished() and not (node is self.d and self.sharers_at_risk(rid))]
        if live:
            rid = self.rng.choice(live)
            status = node.scheduler.requests[rid].status
            self.history[rid].append(("abort", node.k, status.name))
            self.counts[f"{node.name} abort {status.name}"] += 1
            node.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ P
    def p_kv(self) -> dict:
        """P's worker: the leases that ended since its last report are sent."""
        ended, self.ended = self.ended, []
        expired, self.expired_unreported = self.expired_unreported, 0
        self.sent.extend(lease.request_id for lease in ended)
        kv: dict = {}
        if ended:
            kv["finished_sending"] = {lease.request_id for lease in ended}
        if expired:
            kv["worker_meta"] = worker_report(num_expired_leases=expired)
        return kv

    def end_lease(self, token: str, how: str) -> None:
        lease = self.leases.get(token)
        if lease is None or lease.ended:
            return
        lease.ended = how
        del self.leases[token]
        self.ended.append(lease)
        if how == "expired":
            self.expired_unreported += 1
        self.counts[f"lease {how}"] += 1

    def step_p(self) -> None:
        p = self.p
        for due, notice in list(self.notices_due):  # release notices reach P's worker
            if due <= p.k:
                self.notices_due.remove((due, notice))
                lease = self.leases.get(notice.ticket.token)
                if lease is not None and lease.request_id == notice.ticket.remote_request_id:
                    self.end_lease(notice.ticket.token, "released")
        for token, lease in list(self.leases.items()):
            if lease.expires_at <= p.k:
                self.end_lease(token, "expired")
        self.sent: list[str] = []
        (_, meta), finished = p.step(self.p_kv)
        where = p.where()
        for grant in meta.lease_grants:
            ticket = self.p_tickets.pop(grant.request_id, None)
            assert ticket is not None, (where, "a grant without a ticket", grant.request_id)
            assert grant.token == ticket["remote_lease_token"], where
            request = p.scheduler.requests.get(grant.request_id)
            assert request is not None, (where, "a lease on blocks P freed", grant.request_id)
            held = p.block_ids(grant.request_id)[: cdiv(request.num_prompt_tokens, BLOCK_SIZE)]
            assert grant.block_ids == [held] == [list(ticket["remote_block_ids"][0])], where
            prompt = p.prompts[grant.request_id]
            expires = p.k + (10**6 if self.quiet else self.rng.choice([2, 6, 15, 40, 10**6]))
            if self.finishing:
                expires = min(expires, p.k + 30)
            self.leases[grant.token] = Lease(grant.request_id, grant.token, held,
                                             list(grant.block_hashes), prompt, expires)
            self.counts["grants"] += 1
        assert not self.p_tickets, (where, "a ticket without a grant", list(self.p_tickets))
        for rid, out in finished.items():
            params = out.kv_transfer_params
            if params is None:
                continue
            assert out.finish_reason.name == "LENGTH", (where, rid, out.finish_reason)
            self.p_tickets[rid] = params
            self.schedule_handoff(params, p.prompts[rid])
        for rid in self.sent:  # their finished_sending was reported: freed
            assert rid not in p.scheduler.requests, (where, "lease ended, not freed", rid)
        self.check_p()

    def schedule_handoff(self, ticket: dict, prompt: tuple) -> None:
        rng = self.rng
        if self.quiet:
            self.handoffs.append((self.d.k + 1, ticket, prompt))
            return
        r = rng.random()
        if r < 0.08:
            self.counts["ticket dropped"] += 1
            return
        self.handoffs.append((self.d.k + rng.randrange(0, 8), ticket, prompt))
        if r > 0.94:
            self.handoffs.append((self.d.k + rng.randrange(0, 12), ticket, prompt))

    def check_p(self) -> None:
        p, where = self.p, self.p.where()
        blocks = self.p.pool.blocks
        live_rids = {lease.request_id for lease in self.leases.values()}
        pending = set(self.p_tickets) | {lease.request_id for lease in self.ended}
        for rid, request in p.scheduler.requests.items():
            if request.is_finished():
                assert rid in live_rids or rid in pending, (where, "kept with no lease", rid)
        for lease in self.leases.values():
            assert lease.request_id in p.scheduler.requests, (where, "leased, freed", lease)
            for i, block_id in enumerate(lease.block_ids):
                block = blocks[block_id]
                assert block.ref_cnt >= 1, (where, "leased block free", lease.request_id, i)
                need = min((i + 1) * BLOCK_SIZE, len(lease.prompt))
                ids = p.ids_of(p.scheduler.requests[lease.request_id])[i * BLOCK_SIZE:need]
                held = p.content.get(block_id) or []
                assert held[: len(ids)] == ids, (where, "leased block overwritten", i)
                if i < len(lease.block_hashes):  # still cached under its hash
                    assert block.block_hash is not None, (where, "leased block unhashed", i)
                    assert bytes(get_block_hash(block.block_hash)) == lease.block_hashes[i], (
                        where, "leased block rehashed", lease.request_id, i)

    # ------------------------------------------------------------------ D
    def settle(self, pull: Pull) -> set[int]:
        """The worker settles ``pull``: the local blocks that did not land (the landed ones get
        what P's blocks hold); its report and completion notice go out."""
        d, rng, plan, rid = self.d, self.rng, pull.plan, pull.request_id
        local = [b for g in plan.groups for b in g.local_block_ids]
        failed = set(plan.unloadable_block_ids)
        mode = "whole" if plan.refused else pull.mode
        if mode == "whole":
            failed |= set(local)
        elif mode == "from" and local:
            failed |= set(local[rng.randrange(len(local)):])
        elif mode == "random" and local:
            failed |= {b for b in local if rng.random() < 0.4} or {rng.choice(local)}
        lease = self.leases.get(pull.token)
        p_blocks = self.p.pool.blocks
        for group in plan.groups:
            for lb, rb, want in zip(group.local_block_ids, group.remote_block_ids,
                                    group.expected_hashes, strict=True):
                # P's holder serves a block by its hash, or one without under the live lease
                key = p_blocks[rb].block_hash
                served = bytes(get_block_hash(key)) == want if want and key is not None else \
                    not want and lease is not None and rb in lease.block_ids
                if not served:
                    failed.add(lb)
                if lb not in failed:
                    d.content[lb] = list(self.p.content.get(rb) or [GARBAGE] * BLOCK_SIZE)
        for b in failed:
            d.content[b] = [GARBAGE] * BLOCK_SIZE
            if self.debug is not None:
                self.debug[("decode", b)].append((d.k, rid, "failed pull"))
        num_blocks = len(local) + len(plan.unloadable_block_ids)
        dreq = self.dreqs[rid]
        dreq.settled = True
        if failed:
            ids = d.block_ids(rid)
            dreq.failed_at = min(ids.index(b) for b in failed)
            dreq.failed_step = d.k
            if not self.quiet and rng.random() < 0.25 and not plan.sync:  # before it recomputes
                self.abort_soon.append(rid)
        else:
            self.landed_blocks += num_blocks
        self.history[rid].append(("settled", d.k, mode, sorted(failed)))
        self.counts[f"pull {'landed' if not failed else mode}{' sync' if plan.sync else ''}"] += 1
        report = PullReport(rid, num_blocks, len(failed), 0.001, 0.0)
        self.reports += 1
        if not self.quiet and not plan.sync and rng.random() < 0.15:
            self.late_reports.append(report)
        else:
            self.reports_now.append(report)
        if pull.token:  # the puller's completion notice
            self.notices_due.append((self.p.k, _Notice(pull.token, pull.plan)))
        return failed

    def d_kv(self) -> dict:
        """D's worker: the pulls due settle (landed, or failed blocks), their reports."""
        finished = set()
        invalid, self.invalid_now = self.invalid_now, set()
        reports, self.reports_now = self.reports_now, []
        if self.late_reports:
            reports, self.late_reports = self.late_reports + reports, []
        for rid, pull in list(self.pulls.items()):
            if pull.due <= self.d.k:
                del self.pulls[rid]
                invalid |= self.settle(pull)
                finished.add(rid)
        reports, self.reports_now = reports + self.reports_now, []
        kv: dict = {}
        if finished:
            kv["finished_recving"] = finished
        if invalid:
            kv["invalid_block_ids"] = invalid
        if reports:
            kv["worker_meta"] = worker_report(pulls=reports)
        return kv

    def before_d_forward(self, output, meta) -> set[str]:
        """D's worker takes the step's orders: the plans are checked, the sync pulls settle
        before the forward (their failed blocks reported with the step)."""
        for plan in meta.pulls:
            self.check_plan(plan)
            if plan.sync:
                self.invalid_now |= self.settle(self.pulls.pop(plan.request_id))
        # vLLM caches a sync load's blocks as it allocates them: a request of the same step
        # may hit them too, and is then cut back (or failed) with the loading one
        tolerated = set()
        for rid in output.num_scheduled_tokens if self.invalid_now else ():
            ids = self.d.block_ids(rid)
            hit = [i for i, b in enumerate(ids) if b in self.invalid_now]
            if hit:
                tolerated.add(rid)
                dreq = self.dreqs[rid]
                dreq.failed_at = min(hit) if dreq.failed_at is None else dreq.failed_at
                dreq.failed_step = self.d.k
        return tolerated

    def step_d(self) -> None:
        d, rng = self.d, self.rng
        for item in sorted(self.handoffs, key=lambda h: h[0]):
            if item[0] <= d.k + 1:
                self.handoffs.remove(item)
                _, ticket, prompt = item
                r = 1.0 if self.quiet else rng.random()
                kind = "spoiled" if r < 0.07 else "other" if r < 0.14 else \
                    "longer" if r < 0.2 else "shorter" if r < 0.23 else "good"
                self.add_d(ticket, prompt, kind)
        (output, meta), finished = d.step(self.d_kv, self.before_d_forward)
        where = d.where()
        for ticket in meta.tickets_to_watch:
            self.watched[ticket.token] += 1  # (twice: a ticket handed to D twice)
        for ticket in meta.tickets_to_forget:
            self.forgotten[ticket.token] += 1
            assert self.forgotten[ticket.token] <= self.watched[ticket.token], (
                where, "forgotten, not watched", ticket)
        for notice in meta.notices:
            self.said[notice.ticket.token] += 1
            self.notices_due.append((self.p.k + (0 if self.quiet else rng.randrange(0, 3)),
                                     notice))
            if notice.reason.startswith("the ticket is for another prompt"):
                self.refused_locally += 1
            self.counts[f"notice {notice.reason.split(':')[0][:24]}"] += 1
        for rid, out in finished.items():
            dreq = self.dreqs[rid]
            if out.finish_reason.name == "ERROR":
                assert self.policy == "fail" and dreq.failed_at is not None, (where, rid)
        if self.policy == "fail":
            for rid in output.num_scheduled_tokens:
                dreq = self.dreqs[rid]
                assert dreq.failed_at is None or dreq.failed_step == d.k, (
                    where, "ran after a failed pull", rid)
        self.check_d()

    def check_plan(self, plan) -> None:
        d, where = self.d, self.d.where()
        rid = plan.request_id
        dreq = self.dreqs[rid]
        assert not dreq.planned, (where, "planned twice", rid)
        dreq.planned = True
        assert plan.lease is not None and plan.lease.token == dreq.token, (where, rid)
        self.said[plan.lease.token] += 1
        request = d.scheduler.requests[rid]
        ticket = dreq.request.kv_transfer_params
        assert ticket["do_remote_prefill"] is False, (where, "ticket not used up", rid)
        ids = d.block_ids(rid)
        if plan.groups:
            (group,) = plan.groups
            start = ids.index(group.local_block_ids[0]) if group.local_block_ids else 0
            num = len(group.local_block_ids)
            assert group.local_block_ids == ids[start:start + num], (where, rid)
            assert group.remote_block_ids == list(ticket["remote_block_ids"][0])[
                start:start + num], (where, "not paired by position", rid)
            hashes = [bytes(h) for h in request.block_hashes]
            want = [hashes[i] if i < len(hashes) else b"" for i in range(start, start + num)]
            assert group.expected_hashes == want, (where, rid)
        if not plan.sync:
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, (where, rid)
        r = self.rng.random()
        mode = "land" if self.quiet or r < 0.55 else "whole" if r < 0.67 else \
            "from" if r < 0.85 else "random"
        due = d.k + (0 if self.quiet else self.rng.choice([0, 0, 1, 2, 3, 6]))
        self.pulls[rid] = Pull(rid, plan, due, mode, plan.lease.token, dreq.p_prompt)
        self.history[rid].append(("planned", d.k, mode, due))
        self.counts["pulls"] += 1

    def check_d(self) -> None:
        d, where = self.d, self.d.where()
        for rid, request in d.scheduler.requests.items():
            waiting = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            holding = request.is_finished()  # aborted while its pull runs
            if waiting or holding:
                assert rid in self.pulls or rid in d.scheduler.finished_recving_kv_req_ids \
                    or (holding and self.dreqs[rid].settled), (
                        where, "waits with no pull in flight", rid, request.status)
        for token, num in self.said.items():
            assert num <= self.expected_said[token], (where, "said twice", token)

    # ------------------------------------------------------------------ the run
    def tick(self, *, finishing: bool = False) -> None:
        rng = self.rng
        if not finishing and not self.quiet:
            if rng.random() < 0.5:
                for _ in range(rng.randrange(1, 3)):
                    self.add_p(max_tokens=rng.choice([1, 1, 1, 2]))
            if rng.random() < 0.06:
                self.abort(self.p)
            if rng.random() < 0.08:
                self.abort(self.d)
            for rid in self.abort_soon:
                request = self.d.scheduler.requests.get(rid)
                if request is not None and not request.is_finished():
                    self.history[rid].append(("abort soon", self.d.k, request.status.name))
                    self.counts[f"decode abort after failure {request.status.name}"] += 1
                    self.d.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.abort_soon.clear()
        self.step_p()
        self.step_d()

    def run(self, num_ticks: int = 120) -> None:
        try:
            for _ in range(num_ticks):
                self.tick()
            self.finish()
        finally:
            self.p.connector.shutdown()
            self.d.connector.shutdown()

    def finish(self) -> None:
        self.finishing = True
        for lease in self.leases.values():  # no lease outlives the run by much
            lease.expires_at = min(lease.expires_at, self.p.k + 30)
        for _ in range(400):
            busy = (self.p.scheduler.requests or self.d.scheduler.requests or self.handoffs
                    or self.pulls or self.leases or self.ended or self.notices_due
                    or self.late_reports or self.p.in_flight or self.d.in_flight)
            if not busy:
                break
            self.tick(finishing=True)
        else:
            raise AssertionError(f"seed {self.seed}: no quiescence")
        self.check_end()

    def check_end(self) -> None:
        where = f"seed {self.seed} end"
        for node in (self.p, self.d):
            assert_scheduler_empty(node.scheduler)
            sched = node.sched
            assert not sched._tickets and not sched._waiting and not sched._matches, where
            matcher = sched._index_matcher
            assert not (matcher._live or matcher._lookups or matcher._pulled
                        or matcher._answered), where
            assert not node.connector._hit_tiers and not node.connector._params_errors, where
            assert not sched.rank_reports._pending, where
            assert not sched.has_pending_orders(), where
        assert self.said == self.expected_said, (where, "plans + notices per ticket")
        assert self.forgotten == self.watched, (where, "tickets heart-beaten forever")
        stats = self.d.connector.stats
        assert stats.num_loads + stats.num_failed_loads == self.reports + self.refused_locally, (
            where, stats.num_loads, stats.num_failed_loads, self.reports, self.refused_locally)
        assert stats.num_blocks_received == self.landed_blocks, where
        assert self.p.connector.stats.num_expired_leases == self.counts["lease expired"], where


@dataclass(frozen=True)
class _Notice:
    """D's worker's completion notice after a pull (as a release notice to P's worker)."""

    token: str
    plan: Any

    @property
    def ticket(self):
        return self.plan.lease


@pytest.mark.parametrize("seed", SEEDS)
def test_random_pd_interleavings_keep_the_handoff_sound(seed):
    soak = Soak(seed)
    soak.run(NUM_TICKS)
    assert soak.counts["pulls"] > 0, soak.counts


# ---------------------------------------------------------------------- minimal reproducers
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "load_mode 'sync' + recompute: a request that shared a failed sync load's blocks in the "
    "same step keeps them as computed (vLLM leaves their recompute to the loading request); "
    "the loader aborted first, the sharer decodes over KV never written"))
def test_sync_load_failure_then_abort_leaves_a_sharer_on_unwritten_kv():
    """D, ``load_mode`` "sync", ``recompute``. A (P's ticket for a 70-token prompt) is planned
    a sync pull of positions 0-2; vLLM caches A's two full blocks as it allocates them, so B
    (the same 64-token prefix, no ticket) hits them in the same step. The pull fails at A's
    first block. vLLM cuts A back to 0 tokens and, the block being A's to recompute, leaves B
    at its 64 computed tokens. A is aborted before the next step: nobody writes that block,
    and B runs over it (it must be cut back to 0, or failed)."""
    d = make_scheduler("kv_consumer", engine_id="decode", policy="recompute",
                       extra={"load_mode": "sync"})
    x = [(100 + i) % 500 + 3 for i in range(70)]
    a = make_request(x, kv_transfer_params=ticket_for(70))
    b = make_request([*x[:64], 9, 9, 9], max_tokens=3)
    d.add_request(a)
    d.add_request(b)
    first = d.schedule()
    (plan,) = decode_metadata(first.kv_connector_metadata.payload).pulls
    assert plan.sync and plan.request_id == a.request_id
    a_blocks = d.kv_cache_manager.get_block_ids(a.request_id)[0]
    b_blocks = d.kv_cache_manager.get_block_ids(b.request_id)[0]
    assert b_blocks[:2] == a_blocks[:2]  # B's local hit: A's blocks, not loaded yet
    answer = model_runner_output(first, invalid_block_ids={a_blocks[0]})
    answer.sampled_token_ids[answer.req_id_to_index[b.request_id]] = []
    d.update_from_output(first, answer)
    assert a.num_computed_tokens == 0  # A recomputes from its first token...
    d.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)  # ...but is aborted
    second = d.schedule()
    computed = dict(zip(second.scheduled_cached_reqs.req_ids,
                        second.scheduled_cached_reqs.num_computed_tokens, strict=True))
    computed.update((r.req_id, r.num_computed_tokens) for r in second.scheduled_new_reqs)
    # (B cut back to its first token, or failed: either way not run from token 64)
    assert computed.get(b.request_id, 0) == 0, "B runs over a block its loader never wrote"
