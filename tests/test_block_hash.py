"""Block hashing: chaining, tagged extra-key domains, process independence, request hasher."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kvbridge.kvmanager import (
    HASH_FN_NAMES,
    BlockHashListWithBlockSize,
    MultiModalFeature,
    Request,
    RequestStatus,
    SamplingParams,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    get_request_block_hasher,
    get_root_hash,
    hash_block_tokens,
    make_block_hash_with_group_id,
    pack_token_ids,
)

_CROSS_PROCESS_SCRIPT = """
from kvbridge.kvmanager import Request, MultiModalFeature, get_request_block_hasher
for name in ("sha256_cbor", "sha256", "xxhash_cbor"):
    req = Request("r", list(range(40)), block_hasher=get_request_block_hasher(16, name),
                  lora_name="adapter", cache_salt="tenant",
                  mm_features=[MultiModalFeature(identifier="img", offset=10, length=12)])
    print(",".join(h.hex() for h in req.block_hashes))
"""


def _hashes_in_subprocess(python_hash_seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=python_hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", _CROSS_PROCESS_SCRIPT],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )
    return out.stdout.split()


def test_hashes_are_identical_across_processes_with_different_hash_seeds() -> None:
    here = []
    for name in ("sha256_cbor", "sha256", "xxhash_cbor"):
        req = Request(
            "r", list(range(40)), block_hasher=get_request_block_hasher(16, name),
            lora_name="adapter", cache_salt="tenant",
            mm_features=[MultiModalFeature(identifier="img", offset=10, length=12)],
        )
        here.append(",".join(h.hex() for h in req.block_hashes))
    # Python's str hash changes with PYTHONHASHSEED; block hashes must not (nodes compare them).
    assert _hashes_in_subprocess("0") == here
    assert _hashes_in_subprocess("12345") == here


@pytest.mark.parametrize(("name", "digest_size"),
                         [("sha256_cbor", 32), ("sha256", 32), ("xxhash_cbor", 16)])
def test_hash_functions_by_name(name: str, digest_size: int) -> None:
    root = get_root_hash(name)
    assert len(root) == digest_size
    assert get_root_hash(get_hash_fn_by_name(name)) == root  # name and function agree
    assert len(hash_block_tokens(name, None, [1, 2, 3])) == digest_size


def test_root_hashes_differ_per_function_and_unknown_names_are_rejected() -> None:
    assert len({get_root_hash(n) for n in HASH_FN_NAMES}) == 3
    with pytest.raises(ValueError, match="unknown hash function 'md5'"):
        get_hash_fn_by_name("md5")


def test_chain_parent_changes_the_hash() -> None:
    h0 = hash_block_tokens("sha256_cbor", None, [1, 2, 3, 4])
    # The first block hashes against the root, so an explicit root parent gives the same hash.
    assert hash_block_tokens("sha256_cbor", get_root_hash("sha256_cbor"), [1, 2, 3, 4]) == h0
    # The same tokens after a different parent are a different block (different attention past).
    h1 = hash_block_tokens("sha256_cbor", h0, [5, 6, 7, 8])
    other_parent = hash_block_tokens("sha256_cbor", None, [9, 9, 9, 9])
    assert hash_block_tokens("sha256_cbor", other_parent, [5, 6, 7, 8]) != h1


def _request(**kwargs: object) -> Request:
    kwargs.setdefault("block_hasher", get_request_block_hasher(4))
    return Request("r", kwargs.pop("tokens", list(range(12))), **kwargs)  # type: ignore[arg-type]


def test_lora_and_salt_with_the_same_string_differ() -> None:
    assert _request(lora_name="x").block_hashes[0] != _request(cache_salt="x").block_hashes[0]


def test_salt_is_an_extra_key_of_the_first_block_only_but_changes_the_whole_chain() -> None:
    salted = _request(cache_salt="s")
    assert generate_block_hash_extra_keys(salted, 0, 4) == (("cache_salt", "s"),)
    assert generate_block_hash_extra_keys(salted, 4, 8) is None
    plain = _request()
    # Every block differs: block 0 through its key, blocks 1 and 2 through the parent chain.
    assert [a != b for a, b in zip(salted.block_hashes, plain.block_hashes, strict=True)] == [
        True, True, True
    ]


def test_lora_key_is_on_every_block() -> None:
    req = _request(lora_name="a")
    assert [generate_block_hash_extra_keys(req, s, s + 4) for s in (0, 4, 8)] == [
        (("lora", "a"),)
    ] * 3


def test_multimodal_keys_carry_offsets_relative_to_the_block() -> None:
    image = MultiModalFeature(identifier="img", offset=2, length=4)  # tokens 2..5
    req = _request(mm_features=[image])
    # Overlaps block 0 (starts 2 tokens in) and block 1 (started 2 tokens before it); not block 2.
    assert generate_block_hash_extra_keys(req, 0, 4) == (("mm", "img", 2),)
    assert generate_block_hash_extra_keys(req, 4, 8) == (("mm", "img", -2),)
    assert generate_block_hash_extra_keys(req, 8, 12) is None
    moved = _request(mm_features=[MultiModalFeature(identifier="img", offset=1, length=4)])
    assert moved.block_hashes[0] != req.block_hashes[0]  # same image, other position
    other = _request(mm_features=[MultiModalFeature(identifier="img2", offset=2, length=4)])
    assert other.block_hashes[0] != req.block_hashes[0]  # same position, other image


def test_prompt_embeds_enter_the_hash_by_digest() -> None:
    embeds = torch.arange(24, dtype=torch.float32).reshape(12, 2)
    same = _request(prompt_embeds=embeds.clone())
    base = _request(prompt_embeds=embeds)
    changed = embeds.clone()
    changed[5, 0] = -1.0  # a row of block 1
    differ = _request(prompt_embeds=changed)
    assert same.block_hashes == base.block_hashes
    assert differ.block_hashes[0] == base.block_hashes[0]
    assert differ.block_hashes[1] != base.block_hashes[1]
    assert generate_block_hash_extra_keys(base, 0, 4)[0][0] == "prompt_embeds"


@pytest.mark.parametrize(("num_tokens", "num_hashes"), [(1, 0), (15, 0), (16, 1), (17, 1),
                                                        (32, 2), (33, 2)])
def test_only_full_blocks_are_hashed(num_tokens: int, num_hashes: int) -> None:
    req = Request("r", list(range(num_tokens)), block_hasher=get_request_block_hasher(16))
    assert len(req.block_hashes) == num_hashes


def test_appending_outputs_extends_block_hashes_as_blocks_fill() -> None:
    req = Request("r", list(range(14)), block_hasher=get_request_block_hasher(16))
    req.append_output_token_ids(100)
    assert req.block_hashes == []  # 15 tokens
    req.append_output_token_ids([101, 102])  # 17 tokens: block 0 is full now
    assert len(req.block_hashes) == 1
    whole = Request("w", [*range(14), 100, 101, 102], block_hasher=get_request_block_hasher(16))
    assert req.block_hashes == whole.block_hashes  # incremental == from scratch
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (17, 14, 3)
    assert req.output_token_ids == [100, 101, 102]


@pytest.mark.parametrize("group_id", [0, 1, 2**32 - 1])
def test_group_id_key_round_trip(group_id: int) -> None:
    block_hash = hash_block_tokens("sha256_cbor", None, [1])
    key = make_block_hash_with_group_id(block_hash, group_id)
    assert len(key) == len(block_hash) + 4
    assert (get_block_hash(key), get_group_id(key)) == (block_hash, group_id)
    assert make_block_hash_with_group_id(block_hash, (group_id + 1) % 2**32) != key
    with pytest.raises(ValueError, match="does not fit"):
        make_block_hash_with_group_id(block_hash, 2**32)


def test_hash_list_with_larger_block_size_concatenates_fine_hashes() -> None:
    fine = [bytes([i]) * 4 for i in range(5)]
    coarse = BlockHashListWithBlockSize(fine, hash_block_size=4, block_size=8)
    assert len(coarse) == 2  # the fifth fine hash does not complete a coarse block
    assert coarse[1] == fine[2] + fine[3]
    assert coarse[-1] == coarse[1] and coarse[0:2] == [fine[0] + fine[1], fine[2] + fine[3]]
    with pytest.raises(ValueError, match="not a multiple"):
        BlockHashListWithBlockSize(fine, hash_block_size=4, block_size=6)


def test_sampling_params_resolve_skip_reading_prefix_cache() -> None:
    assert SamplingParams().skip_reading_prefix_cache is False
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    explicit = SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)
    assert explicit.skip_reading_prefix_cache is False
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_request_validation_and_status() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r", [])
    req = Request("r", [1, 2, 3])
    assert req.block_hashes == []  # no hasher: never hits
    assert not req.is_finished()
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.is_finished() and req.get_finished_reason() == "length"
    assert not RequestStatus.is_finished(RequestStatus.WAITING_FOR_REMOTE_KVS)


def test_tokens_are_hashed_as_little_endian_uint32() -> None:
    assert pack_token_ids([1, 0x01020304, 2**32 - 1]) == (
        b"\x01\x00\x00\x00" + b"\x04\x03\x02\x01" + b"\xff\xff\xff\xff"
    )
    with pytest.raises(ValueError, match="token id -1 is outside"):
        pack_token_ids([3, -1])
    with pytest.raises(ValueError, match="outside"):
        Request("r", [2**32], block_hasher=get_request_block_hasher(1))


@pytest.mark.parametrize("name", ["sha256_cbor", "sha256", "xxhash_cbor"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_request_hasher_fast_path_equals_hash_block_tokens(name: str, block_size: int) -> None:
    # The request hasher writes canonical CBOR itself; it must equal the per-block cbor2 path
    # over edge token values (CBOR head sizes change at 24, 2**8, 2**16, 2**32).
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1] * 7
    image = MultiModalFeature(identifier="img", offset=5, length=9)
    req = Request("r", tokens, block_hasher=get_request_block_hasher(block_size, name),
                  lora_name="l", cache_salt="s", mm_features=[image])
    parent = None
    expected = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        extra = generate_block_hash_extra_keys(req, start, start + block_size)
        parent = hash_block_tokens(name, parent, tokens[start : start + block_size], extra)
        expected.append(parent)
    assert req.block_hashes == expected
    plain = Request("p", tokens, block_hasher=get_request_block_hasher(block_size, name))
    assert plain.block_hashes[0] == hash_block_tokens(name, None, tokens[:block_size])
