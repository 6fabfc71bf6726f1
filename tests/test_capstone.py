"""Notebook 13's script (``submit.py``, written by its ``%%writefile`` cells) is the notebook's
own lessons put together: its ``DigitsCSV``, ``DigitsNet`` and hooks are the cells' definitions
(the same AST), and it imports only toolkit files, never the course, each with the siblings the
notebook copies beside it. The notebook itself runs the script (nbmake, both lines)."""

from __future__ import annotations

import ast
import json
import re

import pytest
from conftest import REPO

pytestmark = pytest.mark.one_line  # reads source code; runs nothing

NOTEBOOK = REPO / "notebooks" / "13_your_data_to_a_submission.ipynb"
SHARED = ("DigitsCSV", "DigitsNet", "loss_fn", "optimizer_fn", "scheduler_fn")


def _cells() -> list[str]:
    return ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
            if c["cell_type"] == "code"]


def _script() -> str:
    """submit.py as the notebook writes it: one ``%%writefile`` cell, then ``%%writefile -a``."""
    (first,) = [c for c in _cells() if c.startswith("%%writefile {PROJECT}/submit.py\n")]
    parts = [c.split("\n", 1)[1] for c in _cells()
             if c.startswith(("%%writefile {PROJECT}/submit.py\n",
                              "%%writefile -a {PROJECT}/submit.py\n"))]
    assert parts[0] == first.split("\n", 1)[1]  # written first, then appended to
    return "\n".join(parts) + "\n"


def _definitions(source: str) -> dict[str, str]:
    """Top-level classes, functions and assignments by name, as AST dumps (no docstrings)."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            for n in ast.walk(node):
                body = getattr(n, "body", None)
                if (isinstance(n, ast.ClassDef | ast.FunctionDef) and body and isinstance(
                        body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
                    n.body = body[1:] or [ast.Pass()]
            found[node.name] = ast.dump(node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = ast.dump(node.value)
    return found


def test_the_script_defines_what_the_cells_teach():
    lessons = {}
    for cell in _cells():
        if not cell.startswith("%%"):
            lessons.update(_definitions(re.sub(r"^(\s*)[!%].*$", r"\1pass", cell, flags=re.M)))
    script = _definitions(_script())
    for name in SHARED:
        assert script[name] == lessons[name], f"submit.py's {name} differs from the notebook's"


def _toolkit_siblings(module: str) -> set[str]:
    """The toolkit files ``module`` imports (its ``from . import x`` / ``from .x import``)."""
    tree = ast.parse((REPO / "tpu_helpers" / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module} if node.module else {a.name for a in node.names}
    return names


def test_the_script_imports_only_toolkit_files_it_copies():
    tree = ast.parse(_script())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    froms = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    roots |= {m.split(".")[0] for m in froms}
    assert roots <= {"functools", "sys", "pathlib", "numpy", "pandas", "torch", "torch_xla",
                     "tpu_helpers"}, roots
    used = {m.split(".")[1] for m in froms if m.startswith("tpu_helpers.")}
    needed = used | {s for m in used for s in _toolkit_siblings(m)}
    (copy,) = [c for c in _cells() if "shutil.copy" in c]
    copied = set(re.search(r"for unit in \(([^)]*)\)", copy).group(1).replace('"', "")
                 .replace(" ", "").split(","))
    print(f"imports {sorted(used)}, with their siblings {sorted(needed)}; copies {sorted(copied)}")
    assert needed == copied
