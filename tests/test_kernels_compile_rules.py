"""Rules a Triton kernel must follow to compile for a GPU that ``TRITON_INTERPRET=1`` (how the
kernel tests run here) does not enforce.

Found on an H200: a ``@triton.jit`` function that read a plain module-level float failed to
compile ("Cannot access global variable ... from within @jit'ed function"), while every CPU test
passed under the interpreter. Triton's compiler accepts only globals created as
``tl.constexpr(...)`` (or other jit functions and modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
TRITON_MODULES = sorted(KERNELS.glob("*_triton.py"))


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _is_constexpr_call(value: ast.expr) -> bool:
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr == "constexpr")


def _plain_globals_read_by_kernels(tree: ast.Module) -> list[str]:
    plain = {}  # module-level names bound to a value that is not a constexpr
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and not _is_constexpr_call(node.value):
                    plain[target.id] = node.lineno
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(map(_is_jit, node.decorator_list)):
            local = {a.arg for a in node.args.args} | {
                n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Store)}
            found += [f"{node.name} reads {n.id} (line {plain[n.id]})" for n in ast.walk(node)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                      and n.id in plain and n.id not in local]
    return found


def test_there_are_triton_modules_to_check():
    assert TRITON_MODULES, KERNELS


@pytest.mark.parametrize("path", TRITON_MODULES, ids=lambda p: p.name)
def test_kernels_read_no_plain_module_globals(path):
    assert _plain_globals_read_by_kernels(ast.parse(path.read_text())) == []


def test_the_rule_finds_a_plain_global():
    bad = ast.parse("import triton\nX = 1.0\n@triton.jit\ndef k(p):\n    y = X + p\n")
    good = ast.parse("import triton\nX = tl.constexpr(1.0)\n@triton.jit\ndef k(p):\n    y = X\n")
    assert _plain_globals_read_by_kernels(bad) == ["k reads X (line 2)"]
    assert _plain_globals_read_by_kernels(good) == []
