"""The transport's module graph (docs/architecture.md, "Which layer may import which"; STYLE.md,
points 1-2): it imports nothing of ``connector`` or ``kvmanager``, no two of its modules import
each other (directly or round a circle, counting imports inside functions and under
``TYPE_CHECKING``), and every module is small and opens with a docstring saying its role."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TRANSPORT = Path(__file__).resolve().parent.parent / "transport"
PACKAGE = "kvbridge.transport"
MAX_MODULE_LINES = 450


def _modules() -> dict[str, Path]:
    return {path.stem: path for path in sorted(TRANSPORT.glob("*.py"))}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """``(transport modules, other kvbridge packages)`` that ``path`` imports anywhere in it."""
    names = set(_modules())
    local: set[str] = set()
    other: set[str] = set()

    def add(dotted: str) -> None:
        if dotted == PACKAGE:
            local.add("__init__")
        elif dotted.startswith(PACKAGE + "."):
            local.add(dotted.removeprefix(PACKAGE + ".").split(".")[0])
        elif dotted.startswith("kvbridge."):
            other.add(dotted.split(".")[1])

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                add(node.module or "")
                for alias in node.names:  # ``from kvbridge.transport import wire``
                    if node.module == PACKAGE and alias.name in names:
                        local.add(alias.name)
            elif node.level == 1 and node.module:
                local.add(node.module.split(".")[0])
            elif node.level == 1:  # ``from . import x``: module x, or the package itself
                for alias in node.names:
                    local.add(alias.name if alias.name in names else "__init__")
            else:
                other.add("<parent package>")
    local.discard(path.stem)
    return local, other


def test_transport_imports_no_connector_or_kvmanager():
    for name, path in _modules().items():
        _, other = _imports(path)
        assert other <= {"kernels"}, f"transport/{name}.py imports {sorted(other)}"


def test_transport_modules_form_no_import_cycle():
    graph = {name: _imports(path)[0] for name, path in _modules().items()}
    # the package's lazy ``UcxxTransport`` attribute is its only way in; nothing imports it back
    importers_of_package = sorted(name for name, deps in graph.items() if "__init__" in deps)
    assert importers_of_package == []
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*trail, name])
        done.add(name)

    for name in graph:
        visit(name, [])


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_small_and_says_its_role(name):
    path = _modules()[name]
    num_lines = len(path.read_text().splitlines())
    assert num_lines <= MAX_MODULE_LINES, f"transport/{name}.py has {num_lines} lines"
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and len(docstring.split()) >= 8, f"transport/{name}.py: no role stated"
