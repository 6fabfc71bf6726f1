"""The code a learner takes is written once, in a notebook cell, and that cell is what the
notebook runs (d2l's pattern: its library is extracted from the lessons' ``#@save`` cells).

A code cell with a line ``#@save tpu_helpers/<module>.py`` (or ``course/<module>.py``) holds
definitions that are also in that module. This test keeps each of them equal to the module's
(same AST; docstrings and comments are not compared), so a user who copies the module gets
exactly the lines the lesson ran, and no notebook has to run both to prove it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_line  # compares source code (AST) and runs nothing

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^#@save ((?:tpu_helpers|course)/\w+\.py)\s*$", re.M)


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            n.body = body[1:] or [ast.Pass()]
    return node


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def saved_cells(notebook: Path):
    """(cell index, module path, source) of every ``#@save`` cell in ``notebook``."""
    nb = json.loads(notebook.read_text())
    for i, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"])
        m = MARK.search(src) if cell["cell_type"] == "code" else None
        if m:
            yield i, m.group(1), src


CASES = [(nb, i, module, src) for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
         for i, module, src in saved_cells(nb)]


def test_the_course_saves_cells():
    assert CASES, "no notebook cell is marked #@save"


@pytest.mark.parametrize("notebook,index,module,source", CASES,
                         ids=[f"{c[0].name[:2]}-cell{c[1]}" for c in CASES])
def test_saved_cell_equals_its_module(notebook, index, module, source):
    cell_defs = _definitions(_strip_docstrings(ast.parse(source)))
    assert cell_defs, f"{notebook.name} cell {index} is marked #@save but defines nothing"
    module_defs = _definitions(_strip_docstrings(ast.parse((ROOT / module).read_text())))
    for name, node in cell_defs.items():
        assert name in module_defs, (
            f"{notebook.name} cell {index} defines {name}, which {module} does not have")
        assert ast.dump(node) == ast.dump(module_defs[name]), (
            f"{notebook.name} cell {index}: {name} differs from {module}'s; "
            "the cell is what the lesson runs, so change both together")
