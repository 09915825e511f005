"""Reference decoder: the paged forward (chunked, batched, random non-contiguous block tables,
prefix read back from the cache) equals the cache-free ``forward_full``; tokenizer round trip;
checkpoint round trip; seeded init identical across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from kvbridge.kernels import AttentionMetadata, set_default_use_triton
from kvbridge.kernels.model import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ByteTokenizer,
    ModelConfig,
    ReferenceDecoder,
    allocate_kv_caches,
    greedy_sample,
    layer_names_by_type,
    prompt_logprobs,
)

LOGITS_ATOL = 1e-4
"""float32 end to end: the paged path sums attention in another order than forward_full, so
logits (O(1) in size) agree to ~1e-6; 1e-4 leaves room for four layers of accumulation."""

BLOCK_SIZE = 4
NUM_BLOCKS = 64


class _PagedRequest:
    """One sequence's tokens and its random physical blocks (never the null block 0)."""

    def __init__(self, token_ids: list[int], physical_blocks: list[int]) -> None:
        self.token_ids = token_ids
        self.physical_blocks = physical_blocks
        self.num_computed_tokens = 0


def _make_requests(*, prompt_lens: list[int], seed: int, shared_prefix_blocks: int = 0):
    """Requests with distinct random physical blocks, except that the first
    ``shared_prefix_blocks`` blocks of every request are request 0's (a prefix-cache hit)."""
    generator = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    shared_tokens = torch.randint(0, 256, (shared_prefix_blocks * BLOCK_SIZE,),
                                  generator=generator).tolist()
    shared_blocks = [free.pop() for _ in range(shared_prefix_blocks)]
    requests = []
    for prompt_len in prompt_lens:
        tail = torch.randint(0, 256, (prompt_len - len(shared_tokens),), generator=generator)
        blocks = shared_blocks + [free.pop() for _ in range(-(-prompt_len // BLOCK_SIZE)
                                                          - shared_prefix_blocks)]
        requests.append(_PagedRequest(shared_tokens + tail.tolist(), blocks))
    return requests


def _run_step(model, kv_caches, requests, num_new_tokens):
    """One varlen step: request ``r`` computes its next ``num_new_tokens[r]`` tokens. Sliding
    layers see block tables whose blocks wholly before the window are the null block, as vLLM's
    SlidingWindowManager leaves them. Returns the logits of every computed token."""
    config = model.config
    input_ids, positions, query_lens, seq_lens = [], [], [], []
    for request, count in zip(requests, num_new_tokens, strict=True):
        start = request.num_computed_tokens
        input_ids += request.token_ids[start : start + count]
        positions += list(range(start, start + count))
        query_lens.append(count)
        seq_lens.append(start + count)
    positions_t = torch.tensor(positions)
    max_blocks = max(len(request.physical_blocks) for request in requests)
    full_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    for row, request in enumerate(requests):
        full_table[row, : len(request.physical_blocks)] = torch.tensor(request.physical_blocks)
    slots = []
    for request, seq_len in zip(requests, seq_lens, strict=True):
        token_pos = torch.arange(request.num_computed_tokens, seq_len)
        physical = torch.tensor(request.physical_blocks)[token_pos // BLOCK_SIZE]
        slots.append(physical * BLOCK_SIZE + token_pos % BLOCK_SIZE)  # vLLM's slot mapping
    slot_mapping = torch.cat(slots)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    attn_metadata = {}
    for layer_type, names in layer_names_by_type(config).items():
        window = config.sliding_window if layer_type == SLIDING_ATTENTION else None
        table = full_table.clone()
        if window is not None:
            for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
                table[row, : max(0, seq_len - query_len - window + 1) // BLOCK_SIZE] = 0
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=torch.tensor(seq_lens), block_table=table,
            slot_mapping=slot_mapping, block_size=BLOCK_SIZE, sliding_window=window,
        )
        attn_metadata.update(dict.fromkeys(names, metadata))
    hidden = model(torch.tensor(input_ids), positions_t, kv_caches, attn_metadata)
    for request, count in zip(requests, num_new_tokens, strict=True):
        request.num_computed_tokens += count
    return model.compute_logits(hidden)


def _poisoned_kv_caches(config):
    kv_caches = allocate_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    for kv_cache in kv_caches.values():
        kv_cache[0] = float("nan")  # the null block: any read of it would poison the logits
    return kv_caches


@pytest.mark.parametrize("config", [ModelConfig.tiny(), ModelConfig.tiny_hybrid(sliding_window=6)],
                         ids=["full", "hybrid"])
def test_chunked_batched_paged_forward_equals_forward_full(config):
    model = ReferenceDecoder(config)
    kv_caches = _poisoned_kv_caches(config)
    # Prompt lengths: 1 token, block - 1, block, block + 1, many blocks.
    requests = _make_requests(prompt_lens=[1, 3, 4, 5, 23], seed=0)
    chunk_plan = [[1, 2, 4, 5, 7], [0, 1, 0, 0, 9], [0, 0, 0, 0, 7]]  # sums to the prompt lens
    logits = {idx: [] for idx in range(len(requests))}
    for num_new_tokens in chunk_plan:
        active = [idx for idx, count in enumerate(num_new_tokens) if count > 0]
        step_logits = _run_step(model, kv_caches, [requests[i] for i in active],
                                [num_new_tokens[i] for i in active])
        offset = 0
        for idx in active:
            logits[idx].append(step_logits[offset : offset + num_new_tokens[idx]])
            offset += num_new_tokens[idx]
    for idx, request in enumerate(requests):
        expected = model.forward_full(torch.tensor(request.token_ids))
        got = torch.cat(logits[idx])
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
        assert torch.equal(greedy_sample(got), greedy_sample(expected))


@pytest.mark.parametrize("config", [ModelConfig.tiny(), ModelConfig.tiny_hybrid(sliding_window=5)],
                         ids=["full", "hybrid"])
def test_shared_prefix_is_read_back_and_decode_matches(config):
    model = ReferenceDecoder(config)
    kv_caches = _poisoned_kv_caches(config)
    first, second = _make_requests(prompt_lens=[14, 17], seed=1, shared_prefix_blocks=3)
    _run_step(model, kv_caches, [first], [14])
    # The second request's first 3 blocks were written by the first: skip them (prefix hit).
    second.num_computed_tokens = 3 * BLOCK_SIZE
    prefill_logits = _run_step(model, kv_caches, [second], [5])
    expected = model.forward_full(torch.tensor(second.token_ids))
    torch.testing.assert_close(prefill_logits, expected[12:], atol=LOGITS_ATOL, rtol=0)
    # Greedy decode of 3 tokens, one per step (the decode kernel path); 17 + 3 tokens fit the
    # 5 blocks the request already has.
    for _ in range(3):
        second.token_ids.append(int(greedy_sample(expected[-1:])[0]))
        step_logits = _run_step(model, kv_caches, [second], [1])
        expected = model.forward_full(torch.tensor(second.token_ids))
        torch.testing.assert_close(step_logits, expected[-1:], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.triton
def test_paged_forward_on_triton_kernels_equals_forward_full():
    config = ModelConfig.tiny_hybrid(sliding_window=5, num_layers=2,
                                     layer_types=(FULL_ATTENTION, SLIDING_ATTENTION))
    model = ReferenceDecoder(config)
    kv_caches = _poisoned_kv_caches(config)
    requests = _make_requests(prompt_lens=[9, 6], seed=2)
    set_default_use_triton(True)
    try:
        logits = torch.cat([_run_step(model, kv_caches, requests, [5, 6]),
                            _run_step(model, kv_caches, requests[:1], [4])])
    finally:
        set_default_use_triton(None)
    expected_first = model.forward_full(torch.tensor(requests[0].token_ids))
    expected_second = model.forward_full(torch.tensor(requests[1].token_ids))
    torch.testing.assert_close(logits[:5], expected_first[:5], atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(logits[5:11], expected_second, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(logits[11:], expected_first[5:], atol=LOGITS_ATOL, rtol=0)


def test_forward_rejects_bad_input():
    model = ReferenceDecoder(ModelConfig.tiny())
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 258\)"):
        model.forward_full(torch.tensor([1, 258]))
    kv_caches = allocate_kv_caches(model.config, 4, BLOCK_SIZE)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([1]),
        block_table=torch.tensor([[1]], dtype=torch.int32), slot_mapping=torch.tensor([4]),
        block_size=BLOCK_SIZE, sliding_window=32,
    )
    attn_metadata = dict.fromkeys(model.layer_names, metadata)
    with pytest.raises(ValueError, match="sliding_window=None but its metadata says 32"):
        model(torch.tensor([7]), torch.tensor([0]), kv_caches, attn_metadata)


def test_tokenizer_round_trip_and_special_tokens():
    tokenizer = ByteTokenizer()
    for text in ["", "a", "hello, world", "naïve café 🚀 中文"]:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id == 256
        assert tokenizer.decode([*ids, tokenizer.eos_token_id]) == text
    # "é" is two UTF-8 bytes, so two tokens.
    assert tokenizer.encode("é", add_bos=False) == [0xC3, 0xA9]
    assert tokenizer.decode([0xC3]) == "\ufffd"  # a truncated multi-byte character
    assert tokenizer.vocab_size == ModelConfig.tiny().vocab_size == 258


def test_save_and_load_round_trip_gives_identical_logits(tmp_path):
    model = ReferenceDecoder(ModelConfig.tiny_hybrid(seed=7))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 4
    loaded = ReferenceDecoder.from_pretrained(tmp_path)
    assert loaded.config == model.config
    token_ids = torch.tensor(ByteTokenizer().encode("round trip"))
    assert torch.equal(loaded.forward_full(token_ids), model.forward_full(token_ids))


def test_load_reports_missing_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    ReferenceDecoder(ModelConfig.tiny()).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weight model\.layers\.2\.mlp\.up_proj\.weight"):
        ReferenceDecoder.from_pretrained(tmp_path)


def test_tied_embeddings_are_saved_once_and_shared(tmp_path):
    model = ReferenceDecoder(ModelConfig.tiny(tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    loaded = ReferenceDecoder.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


_CHILD = (
    "import torch; from kvbridge.kernels.model import ModelConfig, ReferenceDecoder\n"
    "m = ReferenceDecoder(ModelConfig.tiny_hybrid(seed=3))\n"
    "print(m.forward_full(torch.tensor([256, 72, 105])).double().sum().item().hex())\n"
)


def test_seeded_init_is_identical_in_another_process():
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                           check=True, timeout=120)
    model = ReferenceDecoder(ModelConfig.tiny_hybrid(seed=3))
    here = model.forward_full(torch.tensor([256, 72, 105])).double().sum().item().hex()
    assert child.stdout.strip() == here
    other_seed = ReferenceDecoder(ModelConfig.tiny_hybrid(seed=4))
    assert not torch.equal(other_seed.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_prompt_logprobs_pick_the_next_token():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    result = prompt_logprobs(logits, torch.tensor([2, 2, 0]), num_top=1)
    log_softmax = torch.log_softmax(logits, -1)
    # Position 0 predicts prompt[1] = 2, position 1 predicts prompt[2] = 0; nothing for prompt[0].
    assert torch.equal(result.token_logprobs, torch.stack([log_softmax[0, 2], log_softmax[1, 0]]))
    assert result.top_ids.tolist() == [[2], [0]]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"layer_types": (FULL_ATTENTION,)}, "layer_types has 1 entries"),
        ({"layer_types": (SLIDING_ATTENTION,) * 4}, "need sliding_window"),
        ({"layer_types": ("mamba",) * 4}, "unknown layer type"),
    ],
)
def test_config_rejects_inconsistent_sizes(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**overrides)


def test_layer_names_by_type_of_hybrid():
    assert layer_names_by_type(ModelConfig.tiny_hybrid()) == {
        FULL_ATTENTION: ["model.layers.0.self_attn", "model.layers.2.self_attn"],
        SLIDING_ATTENTION: ["model.layers.1.self_attn", "model.layers.3.self_attn"],
    }
