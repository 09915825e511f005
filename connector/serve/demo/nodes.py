"""Several decode nodes behind one prefill node, for kvbridge-demo ``--nodes N``.

:class:`SpreadRouter` answers :class:`proxy.PDRouter`'s ``complete`` and sends each request to
the least-loaded decode node D (fewest requests in flight; ties in turn). D gets the request's
longest prefix from whichever node the block index names, then the rest from P:

1. The prefix hop, when the index's deepest run of the prompt's blocks is held by another
   decode node and not by D: D is sent the prompt cut to that run plus one token, with
   ``max_tokens`` 1 and no ``kv_transfer_params``. Its connector asks the index
   (docs/architecture.md, "Life of an index hit") and pulls the run from the holder the index
   names (among holders of equal runs the smallest engine id, so pd_pair's ``decode-*`` nodes
   come before ``prefill``), then computes that one token. The hop runs while P prefills the
   whole prompt.
2. The P/D handover (``PDRouter.prefill``, then D with P's ``kv_transfer_params``): D's local
   prefix cache now holds the run, so D pulls only the rest from P (a partial local hit trims
   P's block list from the front).

A run that P holds alone needs no hop (the handover pulls it from P anyway), nor does one D
holds itself. A hop that fails is counted (``prefix_hop_errors``) and the request goes on
through the handover alone; the completion is D's answer to the handover, as with one D.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..proxy import HopError, PDResult, PDRouter, PrefixLocator

__all__ = ["SpreadRouter", "SpreadTally", "engine_ids_of"]


def engine_ids_of(urls: Sequence[str], timeout_s: float = 5.0) -> dict[str, str]:
    """``{url: engine id}`` from each node's ``/health`` (the nodes must be up)."""
    return {url: str(httpx.get(f"{url}/health", timeout=timeout_s).json()["engine_id"])
            for url in urls}


@dataclass(slots=True)
class SpreadTally:
    """What :class:`SpreadRouter` did: requests per decode engine id, prefix hops sent, their
    tokens (the runs asked for) and cached tokens (what D restored without computing: pulled
    or already local), and hops that failed."""

    requests_by_decode_node: dict[str, int] = field(default_factory=dict)
    prefix_hops: int = 0
    prefix_hop_tokens: int = 0
    prefix_hop_cached_tokens: int = 0
    prefix_hop_errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests_by_decode_node": dict(sorted(self.requests_by_decode_node.items())),
            "prefix_hops": self.prefix_hops,
            "prefix_hop_tokens": self.prefix_hop_tokens,
            "prefix_hop_cached_tokens": self.prefix_hop_cached_tokens,
            "prefix_hop_errors": self.prefix_hop_errors,
        }


class SpreadRouter:
    """One prefill node, several decode nodes, prefixes pulled from any holder.

    :meth:`attach` gives it the router of the handover (its P and HTTP client; its decode list
    is not used), made inside the event loop that sends the requests.

    Args:
        decode_url_to_engine_id: every decode node (``engine_ids_of``).
        locator: the block index the nodes publish to; None (an embedded in-memory index per
            node: no cross-node lookups) sends no prefix hop.
        block_size: tokens per block of the nodes.
    """

    def __init__(
        self,
        decode_url_to_engine_id: Mapping[str, str],
        *,
        locator: PrefixLocator | None,
        block_size: int,
    ) -> None:
        if not decode_url_to_engine_id:
            raise ValueError("need at least one decode node")
        self.pd: PDRouter | None = None
        self.tally = SpreadTally()
        self._url_to_engine_id = dict(decode_url_to_engine_id)
        self._engine_id_to_url = {e: u for u, e in self._url_to_engine_id.items()}
        self._in_flight = dict.fromkeys(self._url_to_engine_id, 0)
        self._turn = itertools.count()
        self._locator = locator
        self._block_size = block_size

    def attach(self, pd: PDRouter) -> SpreadRouter:
        """Send the handovers through ``pd`` (which the caller closes); returns self."""
        self.pd = pd
        return self

    def close(self) -> None:
        """Close the index connection (the handover router is the caller's)."""
        if self._locator is not None:
            self._locator.close()

    def choose_decode(self) -> str:
        """The decode node with the fewest requests in flight (ties: in turn)."""
        urls = list(self._in_flight)
        start = next(self._turn) % len(urls)
        rotated = urls[start:] + urls[:start]
        return min(rotated, key=self._in_flight.__getitem__)

    def prefix_to_pull(self, prompt: Sequence[int], decode_url: str) -> int:
        """Blocks of ``prompt`` that ``decode_url`` should pull through the index before the
        handover (0: no hop). Blocking: one index round trip."""
        # The last prompt token is recomputed for its logits: never part of a pull.
        max_blocks = (len(prompt) - 1) // self._block_size
        if self._locator is None or max_blocks <= 0:
            return 0
        holders = self._locator.holders(prompt[: max_blocks * self._block_size])
        deepest = {node_id for node_id, num_blocks in holders if num_blocks == holders[0][1]}
        if not deepest or self._url_to_engine_id[decode_url] in deepest:
            return 0
        if not deepest & self._engine_id_to_url.keys():
            return 0  # P alone holds it: the handover pulls it from P
        return min(holders[0][1], max_blocks)

    async def _prefix_hop(self, pd: PDRouter, url: str, prompt: list[int], num_blocks: int,
                          request_id: str) -> None:
        """D pulls the first ``num_blocks`` blocks of ``prompt`` through the index (never
        raises: a failure is counted and the handover pulls everything from P)."""
        num_tokens = num_blocks * self._block_size
        body = {"prompt": prompt[: num_tokens + 1], "max_tokens": 1, "ignore_eos": True}
        self.tally.prefix_hops += 1
        self.tally.prefix_hop_tokens += num_tokens
        try:
            answer = await pd.post(url, body, f"{request_id}-prefix")
        except (HopError, httpx.HTTPError):
            self.tally.prefix_hop_errors += 1
            return
        cached = int(answer.get("kvbridge", {}).get("num_cached_tokens") or 0)
        self.tally.prefix_hop_cached_tokens += min(cached, num_tokens)

    async def complete(self, body: dict[str, Any], request_id: str | None = None) -> PDResult:
        """A whole (non-streamed) completion: prefix hop (if any) beside P's prefill, then the
        handover to the chosen D. Raises HopError as ``PDRouter.complete``."""
        pd = self.pd
        if pd is None:
            raise RuntimeError("SpreadRouter.complete before attach()")
        pd.check_body(body)
        request_id = request_id or f"pd-{uuid.uuid4().hex}"
        d_url = self.choose_decode()
        engine_id = self._url_to_engine_id[d_url]
        counts = self.tally.requests_by_decode_node
        counts[engine_id] = counts.get(engine_id, 0) + 1
        self._in_flight[d_url] += 1
        try:
            prompt = body["prompt"]  # token ids (pd_pair's workloads); text gets no hop
            num_blocks = 0 if isinstance(prompt, str) else self.prefix_to_pull(prompt, d_url)
            hop = None
            if num_blocks > 0:
                hop = asyncio.ensure_future(
                    self._prefix_hop(pd, d_url, prompt, num_blocks, request_id)
                )
            try:
                p_url, p_answer, p_s = await pd.prefill(body, request_id)
            finally:
                if hop is not None:
                    await hop  # D's prefix must be cached before the handover reaches D
            d_body = {**body, "stream": False, "kv_transfer_params": p_answer["kv_transfer_params"]}
            loop = asyncio.get_running_loop()
            start = loop.time()
            d_answer = await pd.post(d_url, d_body, request_id)
            d_s = loop.time() - start
        finally:
            self._in_flight[d_url] -= 1
        return PDResult(response=d_answer, prefill=p_answer, prefill_url=p_url, decode_url=d_url,
                        prefill_hop_s=p_s, decode_hop_s=d_s)
