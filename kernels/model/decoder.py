"""``ReferenceDecoder``: a small Llama-style decoder whose KV lives in paged blocks.

Architecture (Hugging Face ``LlamaForCausalLM``): token embedding, then per layer
``x += o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))`` and
``x += down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))`` with RMSNorms ``n1``/``n2``, a final
RMSNorm and ``lm_head``. Attention is grouped-query; each layer is full or sliding-window
(``ModelConfig.layer_types``). Parameter names equal Hugging Face's (``model.layers.3.mlp.up_proj
.weight``), so ``state_dict()`` is a Llama checkpoint and module ``model.layers.{i}.self_attn``
names the layer whose KV cache is ``kv_caches["model.layers.{i}.self_attn"]``.

Two forwards with the same weights:

- ``forward_full(token_ids)``: one sequence, plain causal attention, no KV cache: the reference.
- ``forward(input_ids, positions, kv_caches, attn_metadata)``: a flattened varlen batch; each
  layer writes this step's K/V into its cache (``reshape_and_cache`` through the slot mapping)
  and attends over the paged context (``paged_attention`` through the block table), so cached
  prefix tokens are read back, never recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention
from ..cache_ops import reshape_and_cache
from ..host_memory import host_zeros
from ..layout import kv_cache_shape
from .config import ModelConfig, layer_name
from .weights import copy_weights, load_checkpoint, save_checkpoint


class _Linear(nn.Module):
    """``y = x @ weight.T`` with ``weight`` ``[out_features, in_features]`` (no bias)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden_size]`` -> the same shape and dtype (new tensor)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, rope_theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables for ``positions`` (int ``[T]``): cos and sin, float32
    ``[T, head_dim]``, frequencies ``rope_theta ** (-2i / head_dim)`` repeated over both halves
    (Su et al. 2021, in Hugging Face Llama's half-rotation form)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (rope_theta ** (exponents / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, num_heads, head_dim]`` by the tables of ``rope_cos_sin``."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention of one layer (full or sliding window)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_name = layer_name(layer_idx)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.layer_window(layer_idx)
        self.scale = config.head_dim**-0.5
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = _Linear(config.hidden_size, q_size, config.dtype)
        self.k_proj = _Linear(config.hidden_size, kv_size, config.dtype)
        self.v_proj = _Linear(config.hidden_size, kv_size, config.dtype)
        self.o_proj = _Linear(q_size, config.hidden_size, config.dtype)

    def _qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention of one whole sequence ``x`` ``[T, hidden]`` with an explicit mask."""
        q, k, v = self._qkv(x, cos, sin)
        num_tokens = x.shape[0]
        group = self.num_heads // self.num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * self.scale
        pos = torch.arange(num_tokens, device=x.device)
        visible = pos[None, :] <= pos[:, None]
        if self.sliding_window is not None:
            visible &= pos[:, None] - pos[None, :] < self.sliding_window
        scores.masked_fill_(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        return self.o_proj(out.reshape(num_tokens, -1).to(x.dtype))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        use_triton: bool | None,
    ) -> torch.Tensor:
        """Paged attention of a varlen batch: ``x`` ``[num_tokens, hidden_size]`` -> the same
        shape and dtype; ``cos``/``sin`` float32 ``[num_tokens, head_dim]``. Writes this step's
        K/V into ``kv_cache`` through ``attn_metadata.slot_mapping`` (mutated).

        Raises:
            ValueError: when the metadata's sliding window is not this layer's (the layer was
                handed another KV cache group's metadata), or as the cache and attention ops.
        """
        if attn_metadata.sliding_window != self.sliding_window:
            raise ValueError(
                f"{self.layer_name} has sliding_window={self.sliding_window} but its metadata "
                f"says {attn_metadata.sliding_window}: wrong KV cache group for this layer"
            )
        q, k, v = self._qkv(x, cos, sin)
        reshape_and_cache(k, v, kv_cache, attn_metadata.slot_mapping, use_triton=use_triton)
        out = paged_attention(q, kv_cache, attn_metadata, scale=self.scale, use_triton=use_triton)
        return self.o_proj(out.reshape(x.shape[0], -1))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = _Linear(config.hidden_size, config.intermediate_size, config.dtype)
        self.up_proj = _Linear(config.hidden_size, config.intermediate_size, config.dtype)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size, config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> the same shape, ``config.dtype``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Parameters of one pre-norm decoder layer (Hugging Face ``LlamaDecoderLayer`` names);
    ``ReferenceDecoder`` runs the residual arithmetic stated in the module docstring."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config.dtype
        )


class LlamaModel(nn.Module):
    """Embedding, ``config.num_layers`` decoder layers and the final norm (Hugging Face
    ``LlamaModel`` names, so ``state_dict`` keys match a Llama checkpoint)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, config.dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)


class ReferenceDecoder(nn.Module):
    """The reference model. Weights are seeded random (``config.seed``, identical in every
    process) unless ``init_weights=False`` (then ``load_state_dict`` or ``from_pretrained``).

    ``forward`` / ``forward_full`` run under ``torch.inference_mode`` (no autograd).
    """

    def __init__(self, config: ModelConfig, *, init_weights: bool = True) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, config.dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if init_weights:
            self.init_weights(config.seed)
        self.requires_grad_(False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from a CPU ``torch.Generator`` seeded with ``seed``, in
        ``named_parameters`` order (deterministic across processes and devices). Linear weights
        are ``N(0, 1/in_features)`` so activations stay O(1), embeddings ``N(0, 1)``, norm
        weights ``1 + N(0, 0.1^2)``. The global RNG is not touched."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * values
            elif "embed_tokens" not in name:
                values = values * param.shape[-1] ** -0.5
            param.copy_(values.to(param.dtype))

    @property
    def layer_names(self) -> list[str]:
        """KV cache keys, one per layer, in layer order."""
        return [layer.self_attn.layer_name for layer in self.model.layers]

    def _check_token_ids(self, token_ids: torch.Tensor) -> None:
        if token_ids.numel() and (
            int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size
        ):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), got "
                f"[{int(token_ids.min())}, {int(token_ids.max())}]"
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Mapping[str, torch.Tensor],
        attn_metadata: Mapping[str, AttentionMetadata],
        *,
        use_triton: bool | None = None,
    ) -> torch.Tensor:
        """One step over a flattened varlen batch, through the paged KV cache.

        Args:
            input_ids: int64 ``[num_tokens]``, this step's tokens of every request, request by
                request (the order of ``query_start_loc``).
            positions: int64 ``[num_tokens]``, the position of each token in its request.
            kv_caches: layer name -> that layer's KV cache (``layout``); mutated: this step's
                K/V are written at ``slot_mapping``.
            attn_metadata: layer name -> the ``AttentionMetadata`` of the layer's KV cache
                group (vLLM v1 convention: build one object per group and map each of the
                group's layer names to it). Its ``sliding_window`` must equal the layer's.
            use_triton: kernel choice (``dispatch``).

        Returns:
            Final hidden states ``[num_tokens, hidden_size]`` (after the last RMSNorm); pass the
            rows you need to ``compute_logits``.

        Raises:
            ValueError: on a token id outside the vocabulary, a missing layer in ``kv_caches`` /
                ``attn_metadata``, mismatched lengths, or a metadata/layer window mismatch.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must "
                "both be [num_tokens]"
            )
        self._check_token_ids(input_ids)
        for name in self.layer_names:
            if name not in kv_caches or name not in attn_metadata:
                raise ValueError(f"no KV cache or attention metadata for layer {name}")
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            name = layer.self_attn.layer_name
            metadata = attn_metadata[name]
            if metadata.num_actual_tokens != input_ids.shape[0]:
                raise ValueError(
                    f"{name}: slot_mapping has {metadata.num_actual_tokens} rows, "
                    f"input_ids {input_ids.shape[0]}"
                )
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, cos, sin, kv_caches[name], metadata, use_triton)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``lm_head`` of ``hidden_states`` ``[n, hidden_size]``: float32 ``[n, vocab_size]``."""
        return self.lm_head(hidden_states).float()

    @torch.inference_mode()
    def forward_full(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reference forward of ONE sequence with no KV cache.

        Args:
            token_ids: int64 ``[T]``, positions ``0..T-1``.

        Returns:
            float32 logits ``[T, vocab_size]``; row ``t`` predicts token ``t + 1``.

        Raises:
            ValueError: on a token id outside the vocabulary or a non 1-d input.
        """
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be [T], got {tuple(token_ids.shape)}")
        self._check_token_ids(token_ids)
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(token_ids)
        for layer in self.model.layers:
            x = x + layer.self_attn.forward_full(layer.input_layernorm(x), cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.compute_logits(self.model.norm(x))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str | torch.device = "cpu"):
        """Load ``config.json`` + ``model.safetensors`` from ``model_dir`` (see ``weights``);
        tensors are cast to the config's dtype. FileNotFoundError on a missing file,
        ValueError on a missing weight or one of the wrong shape (naming it)."""
        checkpoint = load_checkpoint(model_dir)
        model = cls(checkpoint.config, init_weights=False)
        copy_weights(model.named_parameters(), checkpoint.tensors, checkpoint.weights_path)
        return model.to(device)

    def save_pretrained(self, model_dir: str | Path) -> None:
        """Write ``config.json`` + ``model.safetensors`` into ``model_dir`` (see ``weights``)."""
        save_checkpoint(self.config, self.state_dict(), model_dir)


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Zeroed KV caches for every layer: name -> ``[num_blocks, 2, block_size, num_kv_heads,
    head_dim]`` in ``config.dtype`` (``layout``). Block 0 is the null block by convention."""
    shape = kv_cache_shape(num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if torch.device(device).type == "cpu":
        # Huge pages: peers read these tensors over UCX (kernels/host_memory.py says why).
        return {
            layer_name(layer_idx): host_zeros(tuple(shape), config.dtype)
            for layer_idx in range(config.num_layers)
        }
    return {
        layer_name(layer_idx): torch.zeros(shape, dtype=config.dtype, device=device)
        for layer_idx in range(config.num_layers)
    }
