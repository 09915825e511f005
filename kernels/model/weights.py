"""Hugging Face style checkpoints: ``config.json`` + ``model.safetensors`` (Llama weight names).

Names written and read: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj
.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.
{input,post_attention}_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent when
``tie_word_embeddings``). Tensors are read with the ``safetensors`` library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig

if TYPE_CHECKING:
    from .decoder import ReferenceDecoder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_pretrained(model: ReferenceDecoder, model_dir: str | Path) -> None:
    """Write ``model``'s config and weights into ``model_dir`` (created if missing)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / CONFIG_FILE).write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(model_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def load_pretrained(
    cls: type[ReferenceDecoder], model_dir: str | Path, device: str | torch.device = "cpu"
) -> ReferenceDecoder:
    """Build ``cls`` from ``model_dir``; tensors are cast to the config's dtype.

    Raises:
        FileNotFoundError: if ``config.json`` or ``model.safetensors`` is missing.
        ValueError: on a missing weight or a weight of the wrong shape (naming it). Extra
            tensors in the file (e.g. ``rotary_emb.inv_freq``) are ignored.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_json_file(model_dir / CONFIG_FILE)
    tensors = load_file(str(model_dir / WEIGHTS_FILE), device="cpu")
    model = cls(config, init_weights=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in tensors:
                raise ValueError(f"{model_dir / WEIGHTS_FILE} lacks weight {name}")
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor.to(param.dtype))
    return model.to(device)
