"""kvbridge.kernels.model: the small reference decoder the engine runs on the paged-KV kernels.

A Llama-style model (``decoder``), its sizes (``config``), a byte tokenizer, greedy sampling and
log-probabilities, and Hugging Face-compatible safetensors weights (``weights``). It is a user of
``kvbridge.kernels``, never a dependency of the ops.
"""

from .config import (
    BYTE_VOCAB_SIZE,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    layer_name,
    layer_names_by_type,
)
from .decoder import ReferenceDecoder, allocate_kv_caches
from .sampling import (
    PromptLogprobs,
    compute_logprobs,
    greedy_sample,
    prompt_logprobs,
    token_logprobs,
)
from .tokenizer import ByteTokenizer

__all__ = [
    "BYTE_VOCAB_SIZE",
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "ByteTokenizer",
    "ModelConfig",
    "PromptLogprobs",
    "ReferenceDecoder",
    "allocate_kv_caches",
    "compute_logprobs",
    "greedy_sample",
    "layer_name",
    "layer_names_by_type",
    "prompt_logprobs",
    "token_logprobs",
]
