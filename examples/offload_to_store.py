"""Cold KV blocks offloaded to a store node, then restored instead of recomputed, in one process.

    python examples/offload_to_store.py [INDEX_URL]

An engine with a small block pool offloads its cold cached blocks (``"offload": "evict"``) to a
store node (what ``kvbridge-store`` runs), which publishes them to the index (``INDEX_URL``:
``redis://host:port/db``; by default ``memory``, the in-process index). A second document then
takes the pool and evicts the first one's blocks. When the first document comes back, the
engine finds its prefix on the store through the index and pulls the blocks back. Its tokens
are checked against a single engine that computes everything itself.
"""

from __future__ import annotations

import sys

from kvbridge.connector import create_engine
from kvbridge.connector.store import StoreNode, close_store_node, start_store_node
from kvbridge.kernels.model import ByteTokenizer, ModelConfig, ReferenceDecoder
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams
from kvbridge.transport import LoopbackNetwork

FIRST = "Cold blocks go to the store before the pool reuses them for other requests. " * 4
SECOND = "An unrelated document arrives and needs most of the block pool for itself. " * 4


def engine_config() -> EngineConfig:  # 24 blocks of 16 tokens: room for one document at a time
    return EngineConfig(num_blocks=24, block_size=16, max_model_len=360, max_num_seqs=1)


def run(engine: Engine, request_id: str, prompt: list[int]):
    """Step ``engine`` until ``request_id`` finishes, then one more step (its now cold blocks
    are offloaded then); returns its last output."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=4))
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                engine.step()
                return output


def main(index_url: str = "memory") -> int:
    model = ReferenceDecoder(ModelConfig.tiny())
    tokenizer = ByteTokenizer()
    network = LoopbackNetwork()
    store = start_store_node(StoreNode(
        model.config, block_size=16, capacity_bytes=64 << 20, transport="loopback",
        loopback_network=network, index_url=index_url))
    engine = create_engine(model, engine_config(), {
        "kv_connector": "KVBridgeConnector", "kv_role": "kv_both", "engine_id": "node-a",
        "kv_connector_extra_config": {"transport": "loopback", "index_url": index_url,
                                      "store_url": store.store_url, "offload": "evict"},
    }, loopback_network=network)
    first = tokenizer.encode(FIRST)
    try:
        run(engine, "first-0", first)
        run(engine, "second-0", tokenizer.encode(SECOND))  # evicts most of the first's blocks
        engine.runner.connector.worker_half.offload_sender.wait_idle()  # writes are async
        store.index_client.flush()  # and so is the store's publishing
        again = run(engine, "first-1", first)
        restored = engine.scheduler.connector.stats.snapshot()["num_restored_blocks"]
    finally:
        engine.shutdown()
        close_store_node(store)
    single = run(Engine(model, engine_config()), "first-1", first)
    print(f"restored {restored} blocks from the store found through the index at {index_url}; "
          f"{again.num_cached_tokens} of {len(first)} prompt tokens not recomputed; "
          f"tokens {again.token_ids}")
    if restored == 0 or again.token_ids != single.token_ids:
        print(f"FAILED: a single engine decodes {single.token_ids}")
        return 1
    print("equal to a single engine's tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:2]))
