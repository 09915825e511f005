"""Hugging Face style checkpoints: ``config.json`` + ``model.safetensors`` (Llama weight names).

Names written and read: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj
.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.
{input,post_attention}_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent when
``tie_word_embeddings``). Tensors are read with the ``safetensors`` library.

This module knows state dicts and ``ModelConfig`` only, never the decoder class: the decoder's
``save_pretrained`` / ``from_pretrained`` call it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class Checkpoint(NamedTuple):
    """What ``load_checkpoint`` read: the config and the file's tensors (name -> CPU tensor)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    weights_path: Path


def save_checkpoint(
    config: ModelConfig, state_dict: Mapping[str, torch.Tensor], model_dir: str | Path
) -> None:
    """Write ``config`` and ``state_dict`` into ``model_dir`` (created if missing).

    ``lm_head.weight`` is left out when ``config.tie_word_embeddings`` (it is the embedding).
    Tensors are copied to contiguous CPU tensors first; ``state_dict`` is not mutated.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2))
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in state_dict.items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(model_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def load_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Read ``model_dir``'s config and tensors (on the CPU, in the file's dtypes).

    Raises:
        FileNotFoundError: if ``config.json`` or ``model.safetensors`` is missing.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_json_file(model_dir / CONFIG_FILE)
    weights_path = model_dir / WEIGHTS_FILE
    return Checkpoint(config, load_file(str(weights_path), device="cpu"), weights_path)


@torch.no_grad()
def copy_weights(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    tensors: Mapping[str, torch.Tensor],
    source: str | Path,
) -> None:
    """Copy ``tensors[name]`` into each parameter (mutates the parameters), cast to its dtype.

    Raises:
        ValueError: on a missing weight or a weight of the wrong shape (naming it and
            ``source``). Extra tensors (e.g. ``rotary_emb.inv_freq``) are ignored.
    """
    for name, param in named_parameters:
        if name not in tensors:
            raise ValueError(f"{source} lacks weight {name}")
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(param.shape)}"
            )
        param.copy_(tensor.to(param.dtype))
