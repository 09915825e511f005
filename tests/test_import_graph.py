"""The import graph of kvbridge's four packages, read with ``ast`` (nothing is imported).

docs/architecture.md, "Which layer may import which": dependencies point one way (``connector``
-> ``transport``, ``kvmanager``, ``kernels``; ``kvmanager`` -> ``kernels`` at most;
``transport`` -> ``kernels`` at most; ``kernels`` -> nothing of ours) and there is no import cycle
anywhere. STYLE.md: small modules,
each opening with a docstring that says its role.

Every ``import`` statement counts, wherever it stands: at module level, inside a function, under
``if TYPE_CHECKING:`` or in a ``try``. A module's folder and its ``kvbridge.*`` name come from
``pyproject.toml`` (``[tool.setuptools.package-dir]``); sub-folders (``connector/index``,
``kernels/model``) are sub-packages. ``examples/`` and ``benchmarks/`` scripts are checked for
size and docstrings and join the cycle check under the names ``examples.<stem>`` and
``benchmarks.<stem>`` (they import their siblings as top-level modules; a benchmark may also put
``examples/`` on its path). They use kvbridge as a user would: only names that a package exports
in its ``__all__`` (issue 12).
"""

from __future__ import annotations

import ast
import itertools
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 450
# Our packages, lowest layer first, each with the packages of ours it may import (itself
# included). docs/architecture.md, "Which layer may import which".
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "kernels": frozenset({"kernels"}),
    "kvmanager": frozenset({"kvmanager", "kernels"}),
    "transport": frozenset({"transport", "kernels"}),
    "connector": frozenset({"connector", "transport", "kvmanager", "kernels"}),
}
EXAMPLES_PREFIX = "examples"
BENCHMARKS_PREFIX = "benchmarks"


@dataclass(frozen=True, kw_only=True)
class ImportEdge:
    """One import statement's target: ``source`` imports ``target`` at ``lineno``."""

    source: str
    target: str
    lineno: int


@dataclass(kw_only=True)
class ModuleInfo:
    """One parsed file: its dotted name, path, line count and the ``ast`` tree."""

    name: str
    path: Path
    is_package: bool
    num_lines: int
    tree: ast.Module
    imports: list[ImportEdge] = field(default_factory=list)

    @property
    def rel_path(self) -> str:
        return str(self.path.relative_to(REPO_ROOT))


# ---------------------------------------------------------------------------- discovery
def package_dirs(pyproject: Path = REPO_ROOT / "pyproject.toml") -> dict[str, Path]:
    """``kvbridge.<pkg>`` -> its folder, from ``[tool.setuptools.package-dir]``."""
    config = tomllib.loads(pyproject.read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: REPO_ROOT / folder for name, folder in mapping.items()}


def _module_name(package: str, package_dir: Path, path: Path) -> tuple[str, bool]:
    """``(dotted name, is_package)`` of ``path`` inside ``package_dir`` installed as
    ``package`` (``connector/index/redis_index.py`` -> ``kvbridge.connector.index.redis_index``)."""
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join([package, *parts]), is_package


def _parse(name: str, path: Path, is_package: bool) -> ModuleInfo:
    text = path.read_text(encoding="utf-8")
    return ModuleInfo(
        name=name,
        path=path,
        is_package=is_package,
        num_lines=len(text.splitlines()),
        tree=ast.parse(text, filename=str(path)),
    )


def _python_files(folder: Path) -> Iterator[Path]:
    return (p for p in sorted(folder.rglob("*.py")) if "__pycache__" not in p.parts)


@cache
def package_modules() -> dict[str, ModuleInfo]:
    """Every module of the four packages by dotted name, its imports resolved."""
    modules: dict[str, ModuleInfo] = {}
    for package, folder in package_dirs().items():
        for path in _python_files(folder):
            name, is_package = _module_name(package, folder, path)
            modules[name] = _parse(name, path, is_package)
    for info in modules.values():
        info.imports = list(iter_imports(info, modules))
    return modules


def _script_modules(
    prefix: str, known_before: Mapping[str, ModuleInfo], sibling_prefixes: tuple[str, ...]
) -> dict[str, ModuleInfo]:
    """``<prefix>/*.py`` as ``<prefix>.<stem>``; a bare ``import <stem>`` resolves to the first
    of ``<p>.<stem>`` (``p`` in ``sibling_prefixes``) that is known."""
    modules = {
        f"{prefix}.{path.stem}": _parse(f"{prefix}.{path.stem}", path, False)
        for path in _python_files(REPO_ROOT / prefix)
    }
    known = {**known_before, **modules}
    for info in modules.values():
        info.imports = list(iter_imports(info, known, sibling_prefixes=sibling_prefixes))
    return modules


@cache
def example_modules() -> dict[str, ModuleInfo]:
    """``examples/*.py`` as ``examples.<stem>``; a bare ``import <stem>`` of a sibling
    resolves to it."""
    return _script_modules(EXAMPLES_PREFIX, package_modules(), (EXAMPLES_PREFIX,))


@cache
def benchmark_modules() -> dict[str, ModuleInfo]:
    """``benchmarks/*.py`` as ``benchmarks.<stem>``; a bare ``import <stem>`` resolves to a
    sibling benchmark module, else to an example (``bench_index`` runs ``replay_trace``)."""
    return _script_modules(
        BENCHMARKS_PREFIX,
        {**package_modules(), **example_modules()},
        (BENCHMARKS_PREFIX, EXAMPLES_PREFIX),
    )


# ---------------------------------------------------------------------------- resolution
def resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``.

    ``level`` 1 is the module's own package (the module itself when it is a package's
    ``__init__``), each further dot one package up. ValueError when the dots climb above the
    top package.
    """
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 >= len(base):
        raise ValueError(f"{module}: relative import of level {level} climbs above the top")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def iter_imports(
    info: ModuleInfo, known: Mapping[str, ModuleInfo], *, sibling_prefixes: tuple[str, ...] = ()
) -> Iterator[ImportEdge]:
    """Every import of ``info`` anywhere in its tree, as absolute module names.

    ``from pkg import name`` targets ``pkg.name`` when that is a module we know, else ``pkg``.
    An absolute ``import x`` targets the first ``<p>.x`` (``p`` in ``sibling_prefixes``) that is
    known (scripts that put their own folder, or ``examples/``, on ``sys.path``).
    """

    def sibling(name: str) -> str:
        for prefix in sibling_prefixes:
            candidate = f"{prefix}.{name}"
            if candidate in known:
                return candidate
        return name

    for node in ast.walk(info.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield ImportEdge(source=info.name, target=sibling(alias.name), lineno=node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = resolve_relative(info.name, info.is_package, node.level, node.module)
            else:
                base = sibling(node.module or "")
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in known else base
                yield ImportEdge(source=info.name, target=target, lineno=node.lineno)


def our_package(module: str) -> str | None:
    """``kernels`` for ``kvbridge.kernels.model.decoder``; None for a module not of ours."""
    parts = module.split(".")
    if parts[0] != "kvbridge":
        return None
    return parts[1] if len(parts) > 1 else "kvbridge"


# ---------------------------------------------------------------------------- cycles
def import_graph(modules: Mapping[str, ModuleInfo]) -> dict[str, dict[str, int]]:
    """source -> {target: first line that imports it}, among ``modules`` only (self-imports
    dropped)."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for info in modules.values():
        for edge in info.imports:
            if edge.target in modules and edge.target != info.name:
                graph[info.name].setdefault(edge.target, edge.lineno)
    return graph


def strongly_connected_components(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, each sorted."""
    index_of: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index_of:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index_of[root] = lowlink[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index_of:
                    index_of[child] = lowlink[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    lowlink[node] = min(lowlink[node], index_of[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: Mapping[str, Mapping[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through ``component[0]`` inside ``component``: ``[a, b, ..., a]``."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parent:
                    parent[child] = node
                    next_frontier.append(child)
        frontier = next_frontier
    raise RuntimeError(f"{component} is not a cycle")


def format_cycle(graph: Mapping[str, Mapping[str, int]], cycle: list[str]) -> str:
    """``a -(line 12)-> b -(line 40)-> a``."""
    text = cycle[0]
    for source, target in itertools.pairwise(cycle):
        text += f" -(line {graph[source][target]})-> {target}"
    return text


# ---------------------------------------------------------------------------- assertions
def _assert_none(offenders: list[str], what: str) -> None:
    """Fail listing every offender, one a line."""
    if offenders:
        listing = "\n  ".join(offenders)
        pytest.fail(f"{len(offenders)} {what}:\n  {listing}", pytrace=False)


def _assert_imports_only(packages: set[str], allowed_of: Mapping[str, frozenset[str]]) -> None:
    """Every import of ours from a module of ``packages`` stays within its allowed set."""
    offenders = []
    for info in package_modules().values():
        source = our_package(info.name)
        if source not in packages:
            continue
        for edge in info.imports:
            target = our_package(edge.target)
            if target is not None and target not in allowed_of[source]:
                offenders.append(f"{info.rel_path}:{edge.lineno}: {info.name} -> {edge.target}")
    allowed = "; ".join(f"{p} -> {', '.join(sorted(allowed_of[p]))}" for p in sorted(packages))
    _assert_none(offenders, f"imports against the layering ({allowed})")


def _script_modules_all() -> dict[str, ModuleInfo]:
    return {**example_modules(), **benchmark_modules()}


def _all_modules() -> list[ModuleInfo]:
    return [*package_modules().values(), *_script_modules_all().values()]


# ---------------------------------------------------------------------------- public names
def declared_all(info: ModuleInfo) -> frozenset[str]:
    """The names a module lists in ``__all__`` at module level (``=``, ``+=``, annotated),
    from string literals in a list or tuple; empty when it has none."""
    names: set[str] = set()
    for node in info.tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        if isinstance(value, ast.List | ast.Tuple):
            names.update(
                elt.value
                for elt in value.elts
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str)
            )
    return frozenset(names)


def non_public_imports(info: ModuleInfo, packages: Mapping[str, ModuleInfo]) -> Iterator[str]:
    """Every import of kvbridge in ``info`` that reaches past a package's public names, as
    ``path:line: what``.

    Public is: a package of ours (``kvbridge.connector.store``), a sub-package of it, or a name
    in its ``__all__``. ``from kvbridge.x.y import Z`` with ``kvbridge.x.y`` a plain module, and
    ``from kvbridge.x import Z`` with ``Z`` not in ``kvbridge.x.__all__``, are not.
    """

    def is_package(name: str) -> bool:
        return name in packages and packages[name].is_package

    for node in ast.walk(info.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if our_package(alias.name) is not None and not is_package(alias.name):
                    yield f"{info.rel_path}:{node.lineno}: import {alias.name} (not a package)"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if our_package(module) is None:
                continue
            if not is_package(module):
                yield f"{info.rel_path}:{node.lineno}: from {module} import ... (not a package)"
                continue
            public = declared_all(packages[module])
            for alias in node.names:
                if alias.name in public or is_package(f"{module}.{alias.name}"):
                    continue
                yield (
                    f"{info.rel_path}:{node.lineno}: from {module} import {alias.name}"
                    f" (not in {module}.__all__)"
                )


# ---------------------------------------------------------------------------- tests
def test_every_package_folder_is_parsed():
    # Guards the other tests against passing on nothing: each package of pyproject.toml maps
    # to a folder with modules, and the sub-packages are found.
    dirs = package_dirs()
    assert sorted(dirs) == [f"kvbridge.{p}" for p in sorted(ALLOWED_IMPORTS)]
    names = set(package_modules())
    for package in [
        *dirs,
        "kvbridge.connector.index",
        "kvbridge.connector.store",
        "kvbridge.kernels.model",
    ]:
        assert package in names, f"no {package}/__init__.py found"
    assert "kvbridge.kvmanager.scheduler" in names
    assert example_modules(), "no examples/*.py found"
    assert "benchmarks.bench_kvmanager" in benchmark_modules(), "no benchmarks/*.py found"


def test_relative_imports_resolve_against_the_package():
    # decoder.py is a module of kvbridge.kernels.model: one dot is that package, two dots
    # kvbridge.kernels; in a package's __init__ one dot is the package itself.
    decoder = "kvbridge.kernels.model.decoder"
    assert resolve_relative(decoder, False, 1, "config") == "kvbridge.kernels.model.config"
    assert resolve_relative(decoder, False, 2, "attention") == "kvbridge.kernels.attention"
    assert resolve_relative(decoder, False, 2, None) == "kvbridge.kernels"
    assert resolve_relative("kvbridge.kernels.model", True, 1, "sampling") == (
        "kvbridge.kernels.model.sampling"
    )
    with pytest.raises(ValueError, match="climbs above"):
        resolve_relative("kvbridge.kernels", True, 3, None)


def test_imports_inside_functions_and_type_checking_count(tmp_path):
    # A circle closed only by a function-level import and a TYPE_CHECKING import is a circle.
    source_a = (
        "'''a.'''\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    )
    source_b = "'''b.'''\ndef f():\n    from . import a\n"
    modules = {}
    for stem, source in (("a", source_a), ("b", source_b)):
        path = tmp_path / f"{stem}.py"
        path.write_text(source)
        modules[f"pkg.{stem}"] = _parse(f"pkg.{stem}", path, False)
    for info in modules.values():
        info.imports = list(iter_imports(info, modules))
    graph = import_graph(modules)
    assert graph == {"pkg.a": {"pkg.b": 4}, "pkg.b": {"pkg.a": 3}}
    components = strongly_connected_components(graph)
    assert components == [["pkg.a", "pkg.b"]]
    cycle = shortest_cycle(graph, components[0])
    assert format_cycle(graph, cycle) == "pkg.a -(line 4)-> pkg.b -(line 3)-> pkg.a"


def test_no_module_below_connector_imports_connector():
    offenders = [
        f"{info.rel_path}:{edge.lineno}: {info.name} -> {edge.target}"
        for info in package_modules().values()
        if our_package(info.name) in {"kvmanager", "kernels", "transport"}
        for edge in info.imports
        if our_package(edge.target) == "connector"
    ]
    _assert_none(offenders, "imports of kvbridge.connector from kvmanager/, kernels/, transport/")


def test_kernels_import_nothing_of_ours_outside_kernels():
    _assert_imports_only({"kernels"}, ALLOWED_IMPORTS)


@pytest.mark.parametrize("package", ["kvmanager", "transport"])
def test_kvmanager_and_transport_import_at_most_kernels(package):
    _assert_imports_only({package}, ALLOWED_IMPORTS)


def test_connector_imports_only_the_layers_below():
    _assert_imports_only({"connector"}, ALLOWED_IMPORTS)


def test_no_import_cycles():
    modules = {**package_modules(), **_script_modules_all()}
    graph = import_graph(modules)
    components = strongly_connected_components(graph)
    cycles = [
        format_cycle(graph, shortest_cycle(graph, component))
        + f"  (circle of {len(component)}: {', '.join(component)})"
        for component in components
    ]
    _assert_none(cycles, "import cycles (shortest cycle shown with import lines)")


def test_no_module_over_the_line_limit():
    long_modules = {
        info.rel_path: info.num_lines
        for info in _all_modules()
        if info.num_lines > MAX_MODULE_LINES
    }
    offenders = [
        f"{path}: {num_lines} lines"
        for path, num_lines in sorted(long_modules.items(), key=lambda item: -item[1])
    ]
    _assert_none(offenders, f"modules over {MAX_MODULE_LINES} lines")


def test_every_module_opens_with_a_docstring():
    offenders = []
    for info in _all_modules():
        docstring = ast.get_docstring(info.tree)
        if docstring is None or not docstring.strip():
            offenders.append(info.rel_path)
    _assert_none(offenders, "modules that do not open with a docstring saying their role")


def test_no_example_is_imported_by_the_package_or_another_example():
    # issue 29: each example stands alone, as a user copies it; the package needs none of them
    # (a sibling import resolves to ``examples.<stem>``: example_modules' docstring).
    offenders = [
        f"{edge.source} imports {edge.target} (line {edge.lineno})"
        for info in (*package_modules().values(), *example_modules().values())
        for edge in info.imports
        if edge.target.split(".")[0] == EXAMPLES_PREFIX
    ]
    _assert_none(offenders, "examples imported by the package or by another example")


def test_examples_and_benchmarks_import_only_public_names():
    # examples/ and benchmarks/ use kvbridge as a user would (issue 12): a name that a package
    # does not export is an internal that may move without notice.
    packages = package_modules()
    offenders = [
        offence
        for info in _script_modules_all().values()
        for offence in non_public_imports(info, packages)
    ]
    _assert_none(offenders, "imports of kvbridge internals from examples/ or benchmarks/")


def test_the_public_names_check_catches_a_submodule_and_an_unexported_name():
    # Guards the test above against passing on nothing: a plain module after ``from`` or
    # ``import`` and a name missing from ``__all__`` fail (lines 2, 4, 5); a package's
    # ``__all__`` names (a lazy one included), a sub-package and a bare package pass.
    source = "\n".join([
        '"""probe."""',
        "from kvbridge.connector.store.node import StoreNode",
        "from kvbridge.connector import KVBridgeConnector, index",
        "from kvbridge.connector.index import _no_such_name",
        "import kvbridge.kvmanager.block_pool",
        "import kvbridge.kvmanager",
        "from kvbridge.transport import UcxxTransport",
    ])
    probe = ModuleInfo(
        name="examples._probe",
        path=REPO_ROOT / "examples" / "_probe.py",  # never written: only its name is used
        is_package=False,
        num_lines=7,
        tree=ast.parse(source),
    )
    assert list(non_public_imports(probe, package_modules())) == [
        "examples/_probe.py:2: from kvbridge.connector.store.node import ... (not a package)",
        "examples/_probe.py:4: from kvbridge.connector.index import _no_such_name"
        " (not in kvbridge.connector.index.__all__)",
        "examples/_probe.py:5: import kvbridge.kvmanager.block_pool (not a package)",
    ]
