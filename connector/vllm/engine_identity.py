"""A vLLM engine's ``BlockIdentity`` fields (``kvbridge.transport``): what, beside a block
hash, decides the bytes of the block it names, read from vLLM's config.

The worker half announces the identity in its handshake (the tensors add the layout,
``translate.kv_cache_regions``), and the scheduler half's index namespace is made of that
identity and the engine's tensor-parallel split (``engine_ranks.EngineRanks.index_layout``): one
definition of which engines' blocks are interchangeable (docs/vllm-prefix-reuse.md, "One hash
domain"). Nothing of vLLM is imported: its objects are read by attribute.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from pathlib import Path
from typing import Any

from ..errors import KVTransferConfigError

__all__ = [
    "XXHASH_ALGOS",
    "engine_identity_fields",
    "hash_root_id",
    "kv_cache_dtype_of",
    "local_weights_revision",
    "model_dtype_of",
    "model_revision_of",
    "warn_unnamed_weights",
    "weights_revision_of",
]

logger = logging.getLogger(__name__)

XXHASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})
"""vLLM's ``prefix_caching_hash_algo`` values whose root hash (``NONE_HASH``) is random per
process unless ``PYTHONHASHSEED`` is set (vllm/v1/core/kv_cache_utils.py,
``resolve_none_hash_seed``)."""


def model_revision_of(model_config: Any) -> str:
    """The revision of the weights vLLM loaded (``model_config.revision``): the commit hash it
    resolved a Hub revision to (``huggingface_hub.ResolvedRevision.resolved``), else the
    revision as given, else ``""`` (unknown: a local path without ``--revision``). The code and
    tokenizer revisions are left out: they change no KV byte for a given token id."""
    revision = getattr(model_config, "revision", None)
    if revision is None:
        return ""
    return str(getattr(revision, "resolved", None) or revision)


WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES_PER_FILE = 1024  # read evenly over each weight file, SAMPLE_BYTES each
SAMPLE_BYTES = 4096


def local_weights_revision(model: str) -> str:
    """A revision for weights vLLM loaded from a local path (``model_config.model``: a
    directory, or one file such as a GGUF), which have none of their own: ``"local-"`` and 16
    hex digits of SHA-256 over the directory's ``config.json`` and, for each weight file (by
    name), its name, its size and ``SAMPLES_PER_FILE`` reads of ``SAMPLE_BYTES`` spaced evenly
    over it (4 MiB a file, whatever its size: milliseconds from the page cache vLLM has just
    filled). Copies of one checkpoint on two machines get equal revisions; weights that differ
    get different ones wherever they differ over a run of bytes at least 1/1024 of a file long
    (a fine-tune changes whole tensors), and whatever ``config.json`` changes. Not a checksum of
    every byte: weights differing only in a few short runs may collide, which
    ``model_revision`` in the extra config settles (docs/vllm-prefix-reuse.md, "One hash
    domain"). ``""`` when ``model`` is no local path or holds no weight file. Reads files
    only; raises nothing (an unreadable file gives ``""``)."""
    path = Path(model)
    try:
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(f for f in path.iterdir()
                           if f.suffix in WEIGHT_FILE_SUFFIXES and f.is_file())
        else:
            return ""
        if not files:
            return ""
        digest = hashlib.sha256()
        config = path / "config.json"
        if path.is_dir() and config.is_file():
            digest.update(config.read_bytes())
        for weights in files:
            size = weights.stat().st_size
            digest.update(f"\0{weights.name}\0{size}\0".encode())
            with weights.open("rb") as f:
                for i in range(SAMPLES_PER_FILE):
                    f.seek(size * i // SAMPLES_PER_FILE)
                    digest.update(f.read(SAMPLE_BYTES))
    except OSError:
        return ""
    return "local-" + digest.hexdigest()[:16]


def weights_revision_of(model_config: Any, kv_transfer_config: Any) -> str:
    """The revision ``config_from_vllm`` is given: vLLM's (``model_revision_of``); else, where
    the extra config names none, ``local_weights_revision`` of the local path vLLM loaded
    (``""`` where there is none: the engine then says so at start, ``warn_unnamed_weights``)."""
    revision = model_revision_of(model_config)
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    if revision or extra.get("model_revision"):
        return revision
    return local_weights_revision(str(getattr(model_config, "model", "") or ""))


def kv_cache_dtype_of(cache_config: Any, model_config: Any) -> str:
    """The KV cache dtype vLLM stores (``cache_config.cache_dtype``) for the block identity:
    ``"auto"`` resolved to the model's dtype (``"bfloat16"``: the same bytes as a cache set to
    ``"bfloat16"``), any other name as vLLM spells it (``"fp8_e4m3"`` and ``"fp8_e5m2"`` are
    both ``uint8`` tensors; ``"fp8"`` is kept apart from ``"fp8_e4m3"``: vLLM reads it as e4m3,
    in a variant that depends on the platform), with the layers left unquantized
    (``kv_cache_dtype_skip_layers``) appended: ``"fp8_e4m3+skip:0,sliding_window"``."""
    name = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if name == "auto":
        name = str(model_config.dtype).removeprefix("torch.")
    skipped = getattr(cache_config, "kv_cache_dtype_skip_layers", None) or ()
    return f"{name}+skip:{','.join(sorted(map(str, skipped)))}" if skipped else name


def hash_root_id(
    hash_algo: str, *, python_hash_seed: str | None, default_seed: str, shared: bool = True
) -> str:
    """``BlockIdentity.hash_root`` of this engine: a public name of the root every block hash
    chains from, 16 hex digits of SHA-256 over the algorithm and the seed vLLM derives
    ``NONE_HASH`` from (``PYTHONHASHSEED`` when set, else vLLM's fixed ``default_seed`` for a
    cryptographic algorithm). Two engines whose hashes can agree have equal names; the seed
    itself is never revealed.

    Args:
        hash_algo: ``cache_config.prefix_caching_hash_algo`` (``"sha256"``, ``"xxhash"``...).
        python_hash_seed: the engine process's ``PYTHONHASHSEED`` (None: unset).
        default_seed: vLLM's ``DEFAULT_NONE_HASH_SEED``.
        shared: the engine needs a root other engines share (``index_url``). False: an
            ``xxhash`` root without ``PYTHONHASHSEED`` gets a fresh random name, equal to no
            other engine's (a P/D peer refuses it at the handshake, naming ``hash_root``).

    Raises:
        KVTransferConfigError: ``shared`` and an ``xxhash``-family algorithm without
            ``PYTHONHASHSEED``: its root is random in every process, so no other engine could
            ever match a block.
    """
    if python_hash_seed is None:
        if hash_algo in XXHASH_ALGOS:
            if not shared:
                return "unshared-" + secrets.token_hex(8)
            raise KVTransferConfigError(
                f"kv_connector_extra_config.index_url: prefix_caching_hash_algo={hash_algo!r} "
                "without PYTHONHASHSEED hashes from a random root in each process, so no other "
                "engine can match its blocks; set PYTHONHASHSEED (one value on every engine) "
                "or use prefix_caching_hash_algo='sha256'"
            )
        seed = default_seed
    else:
        seed = python_hash_seed
    return hashlib.sha256(f"{hash_algo}\0{seed}".encode()).hexdigest()[:16]


def model_dtype_of(model_config: Any) -> str:
    """``BlockIdentity.model_dtype``: the dtype the model computes its KV in
    (``model_config.dtype``), with the weights' quantization method appended when vLLM applies
    one (``model_config.quantization``: ``"bfloat16+q:fp8"``), since both change the KV values
    an fp8 cache then stores, which ``kv_cache_dtype`` alone does not say."""
    name = str(getattr(model_config, "dtype", "") or "").removeprefix("torch.")
    quantization = getattr(model_config, "quantization", None)
    return f"{name}+q:{quantization}" if quantization else name


def engine_identity_fields(
    vllm_config: Any, *, python_hash_seed: str | None, default_seed: str, shared: bool
) -> dict[str, str]:
    """The ``BlockIdentity`` fields of a vLLM engine that neither its KV tensors nor the
    connector's settings tell: ``model_dtype``, ``kv_cache_dtype`` and ``hash_root``, as
    keywords of ``KVBridgeWorker.register_kv_caches`` (``model_name`` and ``model_revision``
    are settings, ``config_from_vllm``; ``block_size`` and ``kv_layout`` come from the tensors;
    ``hash_fn_name`` is ``cache_config.prefix_caching_hash_algo``). Reads ``vllm_config`` by
    attribute; mutates nothing.

    Args:
        vllm_config: the engine's ``VllmConfig``.
        python_hash_seed, default_seed, shared: as ``hash_root_id``.

    Raises:
        KVTransferConfigError: as ``hash_root_id``.
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hash_fn_name = str(cache.prefix_caching_hash_algo)
    return {
        "model_dtype": model_dtype_of(model),
        "kv_cache_dtype": kv_cache_dtype_of(cache, model),
        "hash_root": hash_root_id(hash_fn_name, python_hash_seed=python_hash_seed,
                                  default_seed=default_seed, shared=shared),
    }


def warn_unnamed_weights(config: Any, model_config: Any) -> bool:
    """Say once, at start, when this engine shares blocks by name alone: ``index_url`` or
    ``store_url`` set while its weights have no revision (``config.model_revision`` empty: a
    Hub model without ``--revision``, or a local path without weight files of a known suffix,
    ``local_weights_revision``). Any engine on that index
    or store with the same ``model_name`` (vLLM's served model name) and KV geometry is then
    taken to hold the same weights; one with other weights under that name (a fine-tune at the
    same path, weights replaced in place) would be served blocks its weights never computed:
    wrong tokens, no error. Returns whether it warned. Reads ``config`` (kvbridge's
    ``KVTransferConfig``) and ``model_config`` (vLLM's) by attribute."""
    if config.model_revision or not (config.index_url or getattr(config, "store_url", None)):
        return False
    logger.warning(
        "kvbridge: weights %r have no revision, so engines sharing this index or store tell "
        "weights apart by model name %r alone; set kv_connector_extra_config.model_revision to "
        "a name for these weights (one value on every engine that loads them, e.g. a checksum "
        "of the checkpoint) unless every engine under that name loads the same weights",
        str(getattr(model_config, "model", "?")), config.model_name)
    return True
