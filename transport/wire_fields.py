"""The plain structs that control messages carry inside them (``wire``): a read's group
(``GroupReadMsg``), a handoff's lease (``LeaseRef``), a holder's same-host offer
(``CmaOffer``). Bounded by ``limits`` like every field a peer sends; ``wire`` re-exports them.
"""

from __future__ import annotations

import msgspec

from .limits import (
    Address,
    AddressesByGroup,
    BlockHashes,
    BlockIds,
    GroupId,
    Pid,
    Probe,
    RequestId,
    ShortText,
)

__all__ = ["CmaOffer", "GroupReadMsg", "LeaseRef"]


class GroupReadMsg(msgspec.Struct, frozen=True, kw_only=True):
    """One group's part of a ``Read``: remote block ids and, optionally, one expected hash per
    id (``plan``, "Hash checks on the holder"). An empty expected hash is guarded by the read's
    ``lease`` alone, or not checked when the read has none."""

    group_id: GroupId
    block_ids: BlockIds
    expected_hashes: BlockHashes | None

    def __post_init__(self) -> None:
        hashes = self.expected_hashes
        if hashes is not None and len(hashes) != len(self.block_ids):
            raise ValueError(f"{len(hashes)} expected_hashes for {len(self.block_ids)} block_ids")


class CmaOffer(msgspec.Struct, frozen=True, kw_only=True):
    """What a holder on host memory tells requesters at handshake (``HelloOk.cma``).

    Attributes:
        host_id: the holder's boot id; a requester on another boot (another host) ignores it.
        pid: the holder's process id (in the holder's pid namespace).
        probe_address, probe: a live 16-byte buffer in the holder and its content.
        regions: ``[group][layer]`` address of each KV tensor's first byte
            (``[num_blocks, *block_shape]``, contiguous, as ``NodeMetadata`` describes).
        board_address: the holder's block board (``cma_board``: one entry per block of each
            group, ``NodeMetadata``'s ``num_blocks``), which lets a handoff read skip the
            holder's round trip; None: no board (every read asks the holder).
    """

    host_id: ShortText
    pid: Pid
    probe_address: Address
    probe: Probe
    regions: AddressesByGroup
    board_address: Address | None = None


class LeaseRef(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff's lease on the holder, as a read presents it: ``request_id`` names the lease
    there (the prefill side's request id) and ``token`` is its ticket's capability
    (``remote_lease_token``; empty: none presented). The holder's validator serves a position
    with an empty expected hash only while this lease is held, has this token and covers the
    block."""

    request_id: RequestId
    token: ShortText = ""
