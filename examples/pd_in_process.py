"""A P/D handover between two kvbridge engines in one process, over the loopback transport.

    python examples/pd_in_process.py

The prefill engine P runs the prompt with ``{"do_remote_decode": true}`` and one output token;
its ``kv_transfer_params`` (the ticket) go to the decode engine D, which pulls the prompt's KV
and decodes. The tokens are checked against a single engine that computes everything itself.
Swap ``"transport": "loopback"`` for ``"ucxx"`` (and drop ``loopback_network``) to run P and D as
separate processes or hosts.
"""

from __future__ import annotations

from kvbridge.connector import create_engine
from kvbridge.kernels.model import ByteTokenizer, ModelConfig, ReferenceDecoder
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams
from kvbridge.transport import LoopbackNetwork

PROMPT = "KV caches move between nodes so that decoding never waits for a long prefill. " * 3
MAX_TOKENS = 8


def engine_config() -> EngineConfig:
    return EngineConfig(num_blocks=256, block_size=16, max_model_len=512, max_num_seqs=4)


def node(model: ReferenceDecoder, network: LoopbackNetwork, engine_id: str, kv_role: str) -> Engine:
    kv_transfer_config = {
        "kv_connector": "KVBridgeConnector",
        "kv_role": kv_role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {"transport": "loopback"},
    }
    return create_engine(model, engine_config(), kv_transfer_config, loopback_network=network)


def run(engine: Engine, request_id: str, prompt: list[int], max_tokens: int,
        kv_transfer_params: dict | None = None):
    """Step ``engine`` until ``request_id`` finishes; returns its last output."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens),
                       kv_transfer_params)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def main() -> int:
    model = ReferenceDecoder(ModelConfig.tiny())
    prompt = ByteTokenizer().encode(PROMPT)
    network = LoopbackNetwork()
    p = node(model, network, "prefill-0", "kv_producer")
    d = node(model, network, "decode-0", "kv_consumer")
    try:
        ticket = run(p, "req-0", prompt, 1, {"do_remote_decode": True}).kv_transfer_params
        p.step()  # P's next step hands the lease to its worker half, which then serves D
        decoded = run(d, "req-0", prompt, MAX_TOKENS, ticket)
    finally:
        p.shutdown()
        d.shutdown()
    single = run(Engine(model, engine_config()), "req-0", prompt, MAX_TOKENS)
    print(f"D pulled {decoded.num_cached_tokens} of {len(prompt)} prompt tokens from P; "
          f"tokens {decoded.token_ids}")
    if decoded.token_ids != single.token_ids:
        print(f"MISMATCH: a single engine decodes {single.token_ids}")
        return 1
    print("equal to a single engine's tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
