"""The vLLM suite's prompts (token ids for the tiny Llama), by name, and how many tokens D decodes.

Every test module draws from ``PROMPTS``; the session's reference node (a plain vLLM, no
connector) decodes all of them once, so at most two engines are ever alive. Lengths are chosen
around vLLM's 32-token block: one short of a block, exactly one, one over, exactly two, about
2,000, and prompts sharing a long prefix (a multiple of the block size, with suffixes that are
not). Prompts of different groups share nothing, so a test's prefix-cache state does not
depend on which tests ran before it on the same D.
"""

from __future__ import annotations

from _harness import BLOCK, tokens

N_NEW = 8  # greedy tokens D decodes per request

_SHARED = tokens(100, 20 * BLOCK)  # 640 tokens, the handover group's common prefix
_PARTIAL = tokens(200, 10 * BLOCK)  # 320 tokens: D computes it first, then pulls the rest

# The block index group (test_index_prefix_reuse.py): name -> (prefix, suffix), 1,000-2,000
# tokens of prefix (ending on a block boundary or not) and a short suffix.
_INDEX: dict[str, tuple[list[int], list[int]]] = {
    name: (tokens(70 + i, n_prefix), tokens(90 + i, n_suffix))
    for i, (name, n_prefix, n_suffix) in enumerate([
        ("index_a", 1100, 37),
        ("index_b", 1504, 70),
        ("index_c", 2000, 100),
        ("index_stale", 1200, 40),
        ("index_outage", 1000, 30),
        ("index_before_outage", 1300, 50),
        ("index_after_outage", 1250, 33),
        ("index_died", 1400, 20),
        ("index_dtype", 1100, 30),
        ("index_garbage", 1150, 25),
    ])
}

PROMPTS: dict[str, list[int]] = {
    # the handover group (>= 8 prompts, issue 13)
    "t5": tokens(1, 5),
    "t31": tokens(2, 31),
    "t32": tokens(3, 32),
    "t33": tokens(4, 33),
    "t64": tokens(5, 64),
    "t2000": tokens(6, 2000),
    "shared_a": _SHARED + tokens(7, 7),
    "shared_b": _SHARED + tokens(8, 45),
    "shared_c": _SHARED + tokens(9, 100),
    # a partial local hit on D
    "partial_local": _PARTIAL + tokens(10, 50),
    "partial_remote": _PARTIAL + tokens(11, 77),
    # another prompt's ticket: x is at least as long as y (a ticket for more tokens than the
    # prompt has is refused at admission, before any pull), and every block of y's ticket
    # is one of x's full blocks on D, so the holder's hash check refuses each one
    "wrong_x": tokens(20, 5 * BLOCK),
    "wrong_y": tokens(21, 150),
    # the same, for a ticket that carries no remote_prompt_digest (P's hash check refuses it)
    "nodigest_x": tokens(24, 5 * BLOCK),
    "nodigest_y": tokens(25, 150),
    # another prompt's ticket that shares every full block: the two differ only in the partial
    # last block (positions 128-149), which no block hash guards
    "tail_x": tokens(22, 150),
    "tail_y": tokens(22, 150)[:4 * BLOCK] + tokens(23, 150 - 4 * BLOCK),
    # P killed mid-pull, restarted, then stalled
    "stalled": tokens(30, 200),
    "killed": tokens(31, 250),
    "after": tokens(32, 90),
    "after_stall": tokens(35, 95),
    "after_wrong": tokens(36, 85),
    "old_ticket": tokens(33, 120),
    "reborn": tokens(34, 130),
    # a ticket naming P's null block in the full-attention group
    "null_block": tokens(36, 110),
    "after_null_block": tokens(37, 85),
    # vLLM's metrics of the pulls (fresh on every D)
    "metrics_a": tokens(50, 3 * BLOCK),
    "metrics_b": tokens(51, 500),
    # tensor-parallel engines (test_pd_tp.py): one group per pairing, so no D finds a prompt
    # of another pairing in its prefix cache
    "tp_a31": tokens(70, 31), "tp_a64": tokens(71, 64), "tp_a1000": tokens(72, 1000),
    "tp_b31": tokens(73, 31), "tp_b64": tokens(74, 64), "tp_b1000": tokens(75, 1000),
    "tp_c31": tokens(76, 31), "tp_c64": tokens(77, 64), "tp_c1000": tokens(78, 1000),
    "tp_swapped": tokens(79, 300),
    "tp_killed": tokens(80, 600),
    "tp_after": tokens(81, 90),
    # the harness self-check (NixlConnector)
    "nixl_a": tokens(40, 70),
    "nixl_b": tokens(41, 100),
    "nixl_c": _SHARED + tokens(42, 20),
    # the block index (test_index_prefix_reuse.py): each prefix and a suffix of its own
    **{name: prefix + suffix for name, (prefix, suffix) in _INDEX.items()},
}

# Engine A serves INDEX_PREFIXES[name] alone; B the whole prompt PROMPTS[name].
INDEX_PREFIXES = {name: prefix for name, (prefix, _) in _INDEX.items()}

HANDOVER = ["t5", "t31", "t32", "t33", "t64", "t2000", "shared_a", "shared_b", "shared_c"]
PARTIAL_PREFIX_BLOCKS = len(_PARTIAL) // BLOCK
SHARED_PREFIX_BLOCKS = len(_SHARED) // BLOCK

# The hybrid model's prompts (``test_pd_hybrid.py``, window 64 = two blocks): shorter than the
# window, longer by far, and 319 tokens, where P's sliding-window table at finish no longer
# holds the block in which the last prompt token's window starts (vLLM frees what the next
# token's window leaves behind: positions 0..319-64, block 7 ends at 255 = 319 - 64).
HYBRID_PROMPTS: dict[str, list[int]] = {
    "h40": tokens(60, 40),
    "h300": tokens(61, 300),
    "h319": tokens(62, 319),
    "h1000": tokens(63, 1000),
}

# The hybrid model through the block index (``test_index_hybrid.py``): name -> (prefix, suffix).
# One engine serves the prefix alone, another the whole prompt (``hi*``: A then B; ``hs*``: B
# then A); every prefix is far longer than the window, so most of the holder's sliding-window
# blocks are out of any later token's window.
_HYBRID_INDEX: dict[str, tuple[list[int], list[int]]] = {
    name: (tokens(110 + i, n_prefix), tokens(120 + i, n_suffix))
    for i, (name, n_prefix, n_suffix) in enumerate([
        ("hi1000", 1000, 45),
        ("hi1504", 1504, 70),  # ends on a block boundary
        ("hi1990", 1990, 90),
        ("hs1504", 1504, 60),
    ])
}
HYBRID_INDEX_PREFIXES = {name: prefix for name, (prefix, _) in _HYBRID_INDEX.items()}
HYBRID_INDEX_PROMPTS = {name: prefix + suffix for name, (prefix, suffix) in _HYBRID_INDEX.items()}
