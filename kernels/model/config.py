"""``ModelConfig``: the shape of the reference decoder, and reading it from ``config.json``.

Field names follow Hugging Face's ``LlamaConfig`` where one exists (``config.json`` keys in
brackets): ``vocab_size``, ``hidden_size``, ``num_layers`` [``num_hidden_layers``], ``num_heads``
[``num_attention_heads``], ``num_kv_heads`` [``num_key_value_heads``], ``head_dim``,
``intermediate_size``, ``rope_theta``, ``rms_norm_eps``, ``layer_types``, ``sliding_window``,
``dtype`` [``torch_dtype`` or ``dtype``], ``max_position_embeddings``, ``tie_word_embeddings``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

BYTE_VOCAB_SIZE = 258
"""256 byte values, then BOS (256) and EOS (257): see ``tokenizer.ByteTokenizer``."""

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of a Llama-style decoder with a per-layer attention type.

    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"``; a sliding layer
    attends to the ``sliding_window`` most recent positions including its own (position ``p``
    sees keys ``k`` with ``p - sliding_window < k <= p``, Hugging Face / Mistral semantics, the
    same that vLLM's ``SlidingWindowSpec`` assumes). ``seed`` seeds the random weights of
    ``ReferenceDecoder`` when none are loaded.

    Raises:
        ValueError: from ``__post_init__`` on inconsistent sizes.
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    seed: int = 0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}"
            )
        for layer_type in self.layer_types:
            if layer_type not in LAYER_TYPES:
                raise ValueError(
                    f"unknown layer type {layer_type!r}, expected one of {LAYER_TYPES}"
                )
        if SLIDING_ATTENTION in self.layer_types and (
            self.sliding_window is None or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}"
            )
        if self.dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES)}, got {self.dtype}")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads that share one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer_idx: int) -> int | None:
        """Sliding window of layer ``layer_idx`` in tokens, ``None`` for full attention."""
        if self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """Four full-attention layers, hidden 64, 4 heads over 2 KV heads of 16: fast on CPU."""
        fields: dict[str, Any] = dict(
            hidden_size=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            layer_types=(FULL_ATTENTION,) * 4,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def small(cls, **overrides: Any) -> ModelConfig:
        """Six full-attention layers, hidden 384, 6 heads over 2 KV heads of 64 (grouped-query
        attention 3:1, as in Llama-class models): prefill costs far more than its KV weighs to
        move, as in real serving, yet a few hundred tokens still prefill in tens of ms on a CPU."""
        fields: dict[str, Any] = dict(
            hidden_size=384,
            num_layers=6,
            num_heads=6,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=1024,
            layer_types=(FULL_ATTENTION,) * 6,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def tiny_hybrid(cls, **overrides: Any) -> ModelConfig:
        """As ``tiny`` but layers alternate full / sliding (window 32 tokens): two KV cache
        groups for the hybrid coordinator."""
        fields: dict[str, Any] = dict(
            layer_types=(FULL_ATTENTION, SLIDING_ATTENTION) * 2,
            sliding_window=32,
        )
        fields.update(overrides)
        return cls.tiny(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents (Hugging Face ``LlamaConfig`` keys)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "seed": self.seed,
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from ``config.json`` contents. Missing ``head_dim`` is ``hidden_size //
        num_attention_heads``; missing ``num_key_value_heads`` is ``num_attention_heads``;
        missing ``layer_types`` is all full attention (or all sliding when ``sliding_window`` is
        set, as for Mistral).

        Raises:
            ValueError: on a missing required key, an unknown dtype, or inconsistent sizes.
        """
        try:
            num_layers = int(hf["num_hidden_layers"])
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            intermediate_size = int(hf["intermediate_size"])
            vocab_size = int(hf["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from exc
        sliding_window = hf.get("sliding_window")
        default_type = SLIDING_ATTENTION if sliding_window else FULL_ATTENTION
        layer_types = tuple(hf.get("layer_types") or (default_type,) * num_layers)
        dtype_name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if dtype_name not in _DTYPE_NAMES:
            raise ValueError(
                f"unsupported dtype {dtype_name!r}, expected one of {list(_DTYPE_NAMES)}"
            )
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            intermediate_size=intermediate_size,
            layer_types=layer_types,
            sliding_window=int(sliding_window) if sliding_window else None,
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            dtype=_DTYPE_NAMES[dtype_name],
            seed=int(hf.get("seed", 0)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` at ``path`` (see ``from_hf_dict``)."""
        return cls.from_hf_dict(json.loads(Path(path).read_text()))


def layer_name(layer_idx: int) -> str:
    """Name of attention layer ``layer_idx``; its KV cache is keyed by this name."""
    return f"model.layers.{layer_idx}.self_attn"


def layer_names_by_type(config: ModelConfig) -> dict[str, list[str]]:
    """Layer names grouped by attention type, in layer order; only types present are keys.

    Example: ``tiny_hybrid`` gives ``{"full_attention": [layers 0, 2], "sliding_attention":
    [layers 1, 3]}``: one KV cache group per type when the layer counts match.
    """
    by_type: dict[str, list[str]] = {}
    for layer_idx, layer_type in enumerate(config.layer_types):
        by_type.setdefault(layer_type, []).append(layer_name(layer_idx))
    return by_type
