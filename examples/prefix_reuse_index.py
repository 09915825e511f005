"""Prefix reuse across two kvbridge engines through the block index, in one process.

    python examples/prefix_reuse_index.py [INDEX_URL]

Engine A answers a long prompt and publishes its blocks' hashes to the index (``INDEX_URL``:
``redis://host:port/db``; by default ``memory``, the in-process index). Engine B then gets a
prompt that starts with the same text: it asks the index for the longest prefix held elsewhere,
pulls those blocks from A over the (loopback) transport and computes only the rest. B's tokens
are checked against a single engine that computes everything itself.
"""

from __future__ import annotations

import sys

from kvbridge.connector import create_engine
from kvbridge.kernels.model import ByteTokenizer, ModelConfig, ReferenceDecoder
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams
from kvbridge.transport import LoopbackNetwork

DOCUMENT = "A block index maps each block hash to the engines holding it, so any engine " * 6
MAX_TOKENS = 8


def engine_config() -> EngineConfig:
    return EngineConfig(num_blocks=256, block_size=16, max_model_len=1024, max_num_seqs=4)


def node(model: ReferenceDecoder, network: LoopbackNetwork, engine_id: str, index_url: str):
    kv_transfer_config = {
        "kv_connector": "KVBridgeConnector",
        "kv_role": "kv_both",  # serves its blocks to others and pulls theirs
        "engine_id": engine_id,
        "kv_connector_extra_config": {"transport": "loopback", "index_url": index_url},
    }
    return create_engine(model, engine_config(), kv_transfer_config, loopback_network=network)


def run(engine: Engine, request_id: str, prompt: list[int]):
    """Step ``engine`` until ``request_id`` finishes; returns its last output."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def main(index_url: str = "memory") -> int:
    model = ReferenceDecoder(ModelConfig.tiny())
    tokenizer = ByteTokenizer()
    network = LoopbackNetwork()
    a = node(model, network, "node-a", index_url)
    b = node(model, network, "node-b", index_url)
    try:
        run(a, "warm-a", tokenizer.encode(DOCUMENT + "Summary:"))
        a.scheduler.connector.scheduler_half.index_client.flush()  # publishing is asynchronous
        prompt = tokenizer.encode(DOCUMENT + "Question: what does it map?")
        reused = run(b, "req-b", prompt)
    finally:
        a.shutdown()
        b.shutdown()
    single = run(Engine(model, engine_config()), "req-b", prompt)
    print(f"B reused {reused.num_cached_tokens} of {len(prompt)} prompt tokens from A through "
          f"the index at {index_url}; tokens {reused.token_ids}")
    if reused.num_cached_tokens == 0 or reused.token_ids != single.token_ids:
        print(f"FAILED: a single engine decodes {single.token_ids}")
        return 1
    print("equal to a single engine's tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:2]))
