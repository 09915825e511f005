"""vLLM 0.33.0's own block pool, request and hashing code, the baseline of
``bench_kvmanager``: fetch its wheel, extract its Python files, import them.

Where vLLM comes from: it is never installed and never copied into this repository. The wheel is
downloaded (``--fetch-vllm``, ``pip download vllm==0.33.0 --no-deps``) into a cache folder
outside the repository, its ``.py`` files are extracted there, and the folder is put on
``sys.path`` of this process only. ``--vllm-dir`` points at any extracted wheel or source tree
instead. vLLM's import chain reaches modules that are not installed here; the ones in
``VLLM_STUBBED_MODULES`` are replaced, for imports made from vLLM's own modules only, by empty
stand-ins, and the package ``__init__`` files in ``VLLM_SKIPPED_PACKAGE_INITS`` are not run. None
of them is on the block pool or hashing path; vLLM's block pool and hashing code runs unchanged.
Without the vLLM code (no network, no wheel) the vLLM figures are null and the JSON says why.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CACHE_DIR", "VLLM_VERSION", "fetch_vllm", "load_vllm", "resolve_vllm"]

VLLM_VERSION = "0.33.0"
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "kvbridge-bench")
# Third-party modules that vLLM 0.33.0's import chain from vllm.v1.core.block_pool reaches (kv
# events -> zmq/msgspec, config -> transformers/huggingface_hub, request -> sampling params ->
# openai/PIL, ...) and that are not installed here. Each is replaced by an empty stand-in, only
# for imports made from vllm's own modules and only when it is really missing (an installed one is
# used as is). None of them runs on the block pool or hashing path measured below. Platform probes
# (amdsmi, libtpu, tpu_inference, ...) are deliberately absent: they must keep failing with
# ImportError so vLLM does not believe it is on a TPU or a ROCm GPU.
VLLM_STUBBED_MODULES = (
    "aiohttp", "cachetools", "huggingface_hub", "msgspec", "openai", "openai_harmony", "PIL",
    "psutil", "pybase64", "transformers", "uvloop", "xgrammar", "zmq",
)
# Packages whose __init__ is not run (their submodules still load from the real files):
# vllm.v1.structured_output's __init__ builds the structured-output manager (tokenizers, reasoning
# parsers, OpenAI protocol models), which cannot be built over the stand-ins; vllm.v1.request
# needs only its submodule vllm.v1.structured_output.request.
VLLM_SKIPPED_PACKAGE_INITS = ("vllm.v1.structured_output",)


class _StubMeta(type):
    """Classes whose every attribute is another stand-in class (``PIL.Image.Image``), usable in
    annotations (``X | None``, ``X[int]``) and as base classes (with class keywords)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _VllmStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: answers imports of missing ``VLLM_STUBBED_MODULES`` (and their
    submodules) made from a ``vllm.*`` module with a ``_StubModule``; records what it stubbed."""

    def __init__(self) -> None:
        self.stubbed: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] not in VLLM_STUBBED_MODULES:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("importlib", "_frozen_importlib")
        ):
            frame = frame.f_back
        if frame is None or not frame.f_globals.get("__name__", "").startswith("vllm"):
            return None
        self.stubbed.add(fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _extract_wheel(wheel: Path, dest: Path) -> None:
    """Extract the ``.py`` files and metadata of a vLLM wheel (no compiled extensions)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".py") or ".dist-info/" in n]
        archive.extractall(dest, names)


def fetch_vllm(cache_dir: Path) -> Path:
    """``pip download vllm==0.33.0 --no-deps`` into ``cache_dir`` and extract its Python files to
    ``cache_dir/vllm-0.33.0``. Returns that folder. RuntimeError if pip fails."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    dest = cache_dir / f"vllm-{VLLM_VERSION}"
    wheels = sorted(cache_dir.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps",
             "--only-binary", ":all:", "-d", str(cache_dir)],
            capture_output=True, text=True, check=False,
        )
        wheels = sorted(cache_dir.glob(f"vllm-{VLLM_VERSION}-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download vllm=={VLLM_VERSION} failed: "
                               f"{done.stderr.strip().splitlines()[-1:]}")
    if not (dest / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        _extract_wheel(wheels[-1], dest)
    return dest


def load_vllm(vllm_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Import vLLM's block pool, request and hashing modules from ``vllm_dir`` (a folder holding
    the ``vllm`` package). Returns (modules by short name, load info for the JSON). Raises
    whatever the import raises."""
    if not (vllm_dir / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        raise FileNotFoundError(f"no vllm/v1/core/block_pool.py under {vllm_dir}")
    sys.path.insert(0, str(vllm_dir))
    finder = _VllmStubFinder()
    sys.meta_path.append(finder)
    for name in VLLM_SKIPPED_PACKAGE_INITS:
        package = types.ModuleType(name)
        package.__path__ = [str(vllm_dir.joinpath(*name.split(".")))]
        package.__package__ = name
        sys.modules[name] = package
    started = time.perf_counter()
    try:
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils import hashing
        from vllm.v1 import request as vllm_request
        from vllm.v1.core import block_pool, kv_cache_utils
    finally:
        sys.meta_path.remove(finder)
    modules = {"block_pool": block_pool, "kv_cache_utils": kv_cache_utils,
               "hashing": hashing, "request": vllm_request, "SamplingParams": SamplingParams}
    info = {
        "version": getattr(vllm, "__version__", "unknown"),
        "path": str(Path(block_pool.__file__).resolve().parents[3]),
        "import_s": time.perf_counter() - started,
        "stubbed_modules": sorted(finder.stubbed),
        "skipped_package_inits": list(VLLM_SKIPPED_PACKAGE_INITS),
        "default_prefix_caching_hash_algo": _default_hash_algo(vllm_dir),
    }
    return modules, info


def _default_hash_algo(vllm_dir: Path) -> str | None:
    """The default of ``CacheConfig.prefix_caching_hash_algo``, read from vLLM's source text (the
    config module is not imported for this)."""
    source = (vllm_dir / "vllm" / "config" / "cache.py")
    if not source.is_file():
        return None
    for line in source.read_text().splitlines():
        if line.strip().startswith("prefix_caching_hash_algo:") and "=" in line:
            return line.split("=", 1)[1].strip().strip("\"'")
    return None


def resolve_vllm(
    vllm_dir_arg: str | None, fetch: bool, cache_dir: Path
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Load vLLM's code from ``vllm_dir_arg`` (a folder, or a ``.whl`` to extract into
    ``cache_dir``), else fetched into ``cache_dir`` when ``fetch``, else from ``cache_dir``.
    Returns ``load_vllm``'s (modules, load info), or (None, {"reason": ...}) when vLLM's
    code is unavailable."""
    try:
        if vllm_dir_arg is not None:
            vllm_dir = Path(vllm_dir_arg).expanduser()
            if vllm_dir.suffix == ".whl":
                dest = cache_dir / vllm_dir.stem
                if not (dest / "vllm").is_dir():
                    _extract_wheel(vllm_dir, dest)
                vllm_dir = dest
        elif fetch:
            vllm_dir = fetch_vllm(cache_dir)
        else:
            vllm_dir = cache_dir / f"vllm-{VLLM_VERSION}"
            if not (vllm_dir / "vllm").is_dir():
                return None, {"reason": f"vLLM {VLLM_VERSION} code not found at {vllm_dir}; run "
                                        f"with --fetch-vllm (needs network) or --vllm-dir PATH"}
        modules, info = load_vllm(vllm_dir)
    except Exception as exc:  # any failure means "no baseline", said in the JSON
        return None, {"reason": f"could not load vLLM: {type(exc).__name__}: {exc}"}
    if info["version"] != VLLM_VERSION:
        info["warning"] = f"loaded vLLM {info['version']}, the target names {VLLM_VERSION}"
    return modules, info
