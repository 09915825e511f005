"""A tiny random Llama checkpoint (the vLLM demo and suite), written locally with no download.

Run from the vLLM venv (it needs ``transformers``; ``tokenizers`` for the optional tokenizer)::

    python -m kvbridge.connector.serve.demo.tiny_checkpoint [DIR] [--tokenizer] [--check]

``write_tiny_llama(path)`` writes a seeded, float32 ``LlamaForCausalLM`` (hidden 64, 2 layers,
4 heads, 2 KV heads, head_dim 32: the CPU attention backend needs head_dim in {32, 64, ...})
with ``save_pretrained``. With ``tokenizer=True`` it also trains a small byte-level BPE on
the docstrings of Python standard-library modules and saves it next to the weights, so text
prompts work; the model's vocabulary is then the tokenizer's size.

``--check`` loads the checkpoint in vLLM and in Hugging Face transformers and compares greedy
generations token for token.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

SEED = 1234
# Geometry of the tiny model. head_dim is set on its own: 64 / 4 heads would be 16, which the
# CPU attention backend refuses.
GEOMETRY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,  # the suite's longest prompt is about 2,000 tokens
)
# The hybrid variant (``hybrid=True``): four layers, sliding-window and full attention taking
# turns (vLLM's Llama reads ``layer_types``), so vLLM's hybrid allocator makes two KV cache
# groups, one per kind. A 64-token window is two 32-token blocks: prompts of a few hundred
# tokens leave most of a sliding layer's blocks outside the window.
HYBRID = dict(
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=64,
)
TOKENIZER_VOCAB = 1024
# A wide initialisation makes the logits peaked, so greedy decoding does not hinge on
# float-rounding ties between vLLM's kernels and transformers' eager attention.
INITIALIZER_RANGE = 0.5

# Docstring sources for the tokenizer: standard-library modules, read with no network.
_DOC_MODULES = (
    "os", "sys", "re", "json", "collections", "itertools", "functools", "pathlib",
    "subprocess", "threading", "asyncio", "socket", "typing", "dataclasses", "argparse",
    "logging", "unittest", "email", "http.client", "urllib.parse", "string", "textwrap",
    "datetime", "decimal", "fractions", "statistics", "random", "heapq", "bisect", "shutil",
    "tempfile", "inspect", "contextlib", "enum", "abc", "io", "csv", "sqlite3", "zipfile",
)


def _config_key(vocab_size: int, tokenizer: bool, hybrid: bool = False) -> str:
    parts = [GEOMETRY, vocab_size, tokenizer, SEED, INITIALIZER_RANGE, TOKENIZER_VOCAB]
    if hybrid:
        parts.append(HYBRID)  # the plain key is the one earlier runs wrote
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def stdlib_docstrings() -> list[str]:
    """Docstrings of the standard-library modules in ``_DOC_MODULES`` and their members."""
    import importlib
    import inspect

    texts: list[str] = []
    for name in _DOC_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if mod.__doc__:
            texts.append(mod.__doc__)
        for _, member in sorted(vars(mod).items()):
            doc = inspect.getdoc(member) if callable(member) else None
            if doc:
                texts.append(doc)
    return texts


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on standard-library docstrings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_docstrings(), trainer=trainer)
    return tok


def write_tiny_llama(path: str | os.PathLike, *, vocab_size: int = 512,
                     tokenizer: bool = False, hybrid: bool = False) -> Path:
    """Write the checkpoint into ``path`` (created) and return it; ``hybrid``: the
    sliding-window / full-attention variant (``HYBRID``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bos, eos = None, None
    if tokenizer:
        from transformers import PreTrainedTokenizerFast

        tok = train_tokenizer()
        vocab_size = tok.get_vocab_size()
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=vocab_size,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype="float32",
        **{**GEOMETRY, **(HYBRID if hybrid else {})},
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def tiny_llama(root: str | os.PathLike | None = None, *, tokenizer: bool = False,
               hybrid: bool = False) -> Path:
    """The checkpoint under ``root`` (default: the kvbridge cache), written once per config."""
    if root is None:
        cache = os.environ.get("KVBRIDGE_CACHE", os.path.expanduser("~/.cache/kvbridge-vllm"))
        root = Path(cache) / "models"
    kind = "tiny-hybrid-llama" if hybrid else "tiny-llama"
    path = Path(root) / f"{kind}-{_config_key(512, tokenizer, hybrid)}"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_tiny_llama(tmp, tokenizer=tokenizer, hybrid=hybrid)
        try:
            os.rename(tmp, path)
        except OSError:  # another process got there first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


PROMPTS = [
    [1, 7, 42, 99, 300, 5, 17, 250, 11, 3],
    list(range(20, 90)),  # 70 tokens: spans three 32-token blocks
]


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False,
                               min_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


TEXT_PROMPTS = ["Return the absolute path of a file.", "Create a new dictionary with keys"]


def vllm_greedy(path: Path, prompts: list[list[int]] | list[str], max_new_tokens: int,
                **llm_kwargs) -> list[list[int]]:
    """Greedy generations; text prompts need the checkpoint's tokenizer."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    kwargs = dict(model=str(path), skip_tokenizer_init=True, enforce_eager=True,
                  dtype="float32", block_size=32, kv_cache_memory_bytes=64 << 20,
                  max_model_len=1024, max_num_seqs=8, seed=0)
    kwargs.update(llm_kwargs)
    llm = LLM(**kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    res = llm.generate([p if isinstance(p, str) else {"prompt_token_ids": p}
                        for p in prompts], sp)
    return [list(r.outputs[0].token_ids) for r in res]


def main(argv: list[str]) -> int:
    import time

    args = [a for a in argv if not a.startswith("--")]
    with_tok = "--tokenizer" in argv
    t0 = time.monotonic()
    path = write_tiny_llama(args[0], tokenizer=with_tok) if args else tiny_llama(tokenizer=with_tok)
    print(f"checkpoint {path} in {time.monotonic() - t0:.1f}s")
    if "--check" in argv:
        n = 16
        t0 = time.monotonic()
        prompts: list = PROMPTS
        llm_kwargs = {}
        if with_tok:  # text prompts through the trained tokenizer
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            prompts = [tok(t)["input_ids"] for t in TEXT_PROMPTS]
            llm_kwargs["skip_tokenizer_init"] = False
        hf = hf_greedy(path, prompts, n)
        print(f"hf: {time.monotonic() - t0:.1f}s")
        t0 = time.monotonic()
        vl = vllm_greedy(path, TEXT_PROMPTS if with_tok else prompts, n, **llm_kwargs)
        print(f"vllm (incl. start): {time.monotonic() - t0:.1f}s")
        for i, (a, b) in enumerate(zip(hf, vl, strict=False)):
            print(f"prompt {i}: hf   {a}\n          vllm {b}\n          match={a == b}")
        if hf != vl:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
