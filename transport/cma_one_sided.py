"""The requester's side of a one-sided handoff read (``cma_board``): the expected tags of a
read's blocks, the board checks around the copy, and the copy plan.

Two callers use it: ``CmaReadPath`` (on the transport's event loop, as the first try of a
``copy_first`` read), and ``UcxxTransport.read_one_sided`` (on the caller's thread, the decode
engine's, so that a small handoff lands within the engine step that asked for it, with no hop
to the event loop and back).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cma import CmaPeer, CmaPlan, CmaReadError
from .cma_board import BoardCheck, full_block_tag, lease_block_tag
from .heads import heads_error
from .metadata import NodeMetadata
from .wire import GroupReadMsg, LeaseRef

__all__ = ["OneSidedRead"]


class OneSidedRead:
    """One read checked on the holder's board alone; used once, on one thread.

    Args:
        peer: the holder, accepted for same-host reads with a board
            (``peer.offer.board_address`` set).
        remote: the holder's metadata (its blocks per group).
        local_kv_caches_by_group: this node's ``[group][layer]`` KV tensors; the read's local
            blocks are written (only those).
        groups: the read, checked against this node's layout (``plan.build_group_msgs``), with
            expected hashes in every group.
        local_block_ids: per entry of ``groups``, the local ids.
        lease: the handoff's lease; it names the tag of a position without a hash.
        heads: the model's KV heads the read expects (``Read.heads``; None: those ``local``
            holds, or whole rows), and
        local: this node's metadata (needed with ``heads``). The holder is not asked, so the
            requester checks here that the holder's handshake said it holds them
            (``heads.heads_error``).

    Raises:
        ValueError: a remote id outside the holder's blocks, a group without expected
            hashes, or heads the holder (or this node) does not hold as asked.
    """

    def __init__(
        self,
        peer: CmaPeer,
        remote: NodeMetadata,
        local_kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        groups: Sequence[GroupReadMsg],
        local_block_ids: Sequence[Sequence[int]],
        lease: LeaseRef,
        *,
        heads: tuple[int, int] | None = None,
        local: NodeMetadata | None = None,
    ):
        if peer.offer.board_address is None:
            raise ValueError("the holder offers no block board")
        if heads is None and local is not None and local.kv_heads is not None:
            heads = local.held_heads  # as ``transfer.begin_read``: the heads this node holds
        for side, metadata in (("holder", remote), ("requester", local)):
            error = None if metadata is None else heads_error(metadata, heads)
            if error is not None:
                raise ValueError(f"{side}: {error}")
        if heads is not None and local is None:
            raise ValueError("a read of heads needs this node's metadata (local)")
        self._heads, self._local = heads, local
        partial_tag = lease_block_tag(lease.request_id, lease.token)
        blocks = []
        for group in groups:
            if group.expected_hashes is None:
                raise ValueError(f"group {group.group_id}: a one-sided read needs expected hashes")
            tags = [full_block_tag(h) if h else partial_tag for h in group.expected_hashes]
            blocks.append((group.group_id, group.block_ids, tags))
        # ids outside the holder's blocks raise ValueError here, before any address is made
        self._check = BoardCheck(
            peer.offer.pid,
            peer.offer.board_address,
            [group.num_blocks for group in remote.groups],
            blocks,
        )
        self._peer = peer
        self._caches = local_kv_caches_by_group
        self._entries = [
            (group.group_id, group.block_ids, local)
            for group, local in zip(groups, local_block_ids, strict=True)
        ]
        self.num_blocks = sum(len(group.block_ids) for group in groups)
        self.plan: CmaPlan | None = None

    def before_copy(self) -> bool:
        """Check the board; when it vouches for every block, make ``plan``. False: copy
        nothing.

        Raises:
            CmaReadError: the holder's memory could not be read.
        """
        if not self._check.before_copy():
            return False
        self.plan = self._peer.plan(
            self._caches, self._entries, heads=self._heads, local=self._local
        )
        return True

    def after_copy(self) -> bool:
        """Check the holder is the process it was and that no entry moved since
        ``before_copy``. True: every block of the plan landed, bytes-exact.

        Raises:
            CmaReadError: the holder's memory could not be read, or its probe changed
                (another process has its pid).
        """
        if self._peer.read_probe() != self._peer.offer.probe:
            raise CmaReadError("the holder's probe changed: another process has its pid")
        return self._check.after_copy()
