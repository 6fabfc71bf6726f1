"""Which tests `make test` runs on the torch_xla 2.8 line too (the ``both_lines`` marker).

`make test` runs every test on the 2.9 line (Colab's) and, on the 2.8 line (Kaggle's), every
notebook (in the platform run) plus only the tests marked ``both_lines``. ``tests/conftest.py``
marks a test when its code touches something whose behaviour the torch_xla line can change. Its
code is the test function plus what it uses from its own file, followed by name: module-level
constants (the scripts it runs in subprocesses), helpers and fixtures, the imports it uses, and
the benchmarks and examples it names. "Touches" means:

* a pattern of :data:`LINE_SENSITIVE`: code we do not control that calls torch_xla (Lightning,
  transformers/accelerate, jax/torchax/flax), a torch_xla API the lines treat differently (each
  entry says where that is written down), torch_xla's private C API, the doctor;
* a name of a toolkit or course module that branches on the release
  (:func:`version_branching_modules`: ``"2.8"``/``"2.9"`` as a value in its code, and what
  uses it).

Everything else tests our own logic (samplers, ordering, checkpoint files, data checks,
notebook format, the loop's bookkeeping) through the same torch_xla calls the notebooks make,
and every notebook runs on both lines. A test may also carry the mark by hand. `make test-2.8`
alone runs everything. ``tests/test_lines.py`` checks the rule on known tests.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: pattern -> why a test that matches it can behave differently on 2.8 and 2.9
LINE_SENSITIVE = {
    r"\b(import|from) (lightning|pytorch_lightning)\b|\b(tpu_lightning|lightning_writer)\b":
        "Lightning calls torch_xla from its own code (strategies, precision plugins)",
    r"\b(import|from) (transformers|accelerate)\b|\bcourse\.hf\b":
        "transformers' Trainer and accelerate call torch_xla internals (REFERENCE 10)",
    r"\b(import|from) (jax|torchax|flax)\b|find_spec\(.jax.\)":
        "torch_xla takes other paths when jax imports, and the lines differ there (2.9 "
        "configures jax's partitioner, 2.8 does not: tpu_helpers/spmd.py; 2.8 logs a notice "
        "when jax is missing: course/setup.py)",
    r"GradScaler|torch_xla\.amp\b":
        "torch_xla.amp.GradScaler exists in 2.8 only (REFERENCE 10)",
    r"\bmesh_reduce\b":
        "2.9 emits a DeprecationWarning from inside mesh_reduce (REFERENCE 3)",
    r"distributed_checkpoint|\bdist_cp\b|distributed\.checkpoint":
        "torch 2.9's checkpoint reader asks for a rank's own file, 2.8's does not "
        "(tpu_helpers/sharded_checkpoint.py)",
    r"debug\.profiler|\bxp\.(Trace|StepTrace|start_trace)":
        "2.8 logs a jax notice at every profiler trace (course/setup.py)",
    r"torch_xla\.compile\b|\bopenxla\b":
        "which compiled step trains correctly is per line (issue 28, part 1)",
    r"\b_XLAC\b":
        "torch_xla's private C API (and the XLA behind it): no promise between releases",
    r"\btpu_helpers\.doctor\b|\bdoctor_run\b|\bimport doctor\b":
        "the doctor reports what the installed torch_xla has (e.g. GradScaler only in 2.8)",
}

RELEASE = re.compile(r"^2\.[89](\.\d+)?$")


def _tops(tree: ast.Module) -> dict[str, ast.AST]:
    """A module's top-level functions, classes and assigned names."""
    tops = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            tops[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        tops[name.id] = node
    return tops


def _refs(node: ast.AST) -> set[str]:
    """Names, attribute names and parameters (fixtures) in ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


@functools.cache
def version_branching_modules() -> dict[str, frozenset[str]]:
    """Toolkit and course modules that branch on the release: ``{module: names}``, the names
    being the module's top-level functions, classes and constants that hold a release as a
    value (``"2.8"``, ``"2.9"``: a key, a member, a comparison) or use one that does."""
    found = {}
    for path in sorted([*REPO.glob("tpu_helpers/*.py"), *REPO.glob("course/*.py")]):
        tops = _tops(ast.parse(path.read_text()))
        names = {name for name, node in tops.items() if any(
            isinstance(c, ast.Constant) and isinstance(c.value, str) and RELEASE.match(c.value)
            for c in ast.walk(node))}
        while True:  # and what uses them, inside the module
            more = {name for name, node in tops.items() if name not in names
                    and {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & names}
            if not more:
                break
            names |= more
        if names:
            found[f"{path.parent.name}.{path.stem}"] = frozenset(names)
    return found


def mentions(text: str, module: str, names) -> bool:
    """Whether ``text`` imports ``module`` (``pkg.mod`` anywhere, or ``from pkg import mod``) and
    names one of ``names``."""
    package, name = module.split(".")
    imported = re.search(rf"\b{package}\.{name}\b", text) or any(
        name in re.split(r"[\s,]+", m.group(1))
        for m in re.finditer(rf"from {package} import \(?([\w\s,]+)\)?", text))
    return bool(imported) and any(re.search(rf"\b{n}\b", text) for n in names)


def runs(text: str) -> str:
    """``text`` plus the benchmarks and examples it names (a test runs them in a subprocess)."""
    named = [p.read_text() for p in sorted([*REPO.glob("benchmarks/*.py"),
                                            *REPO.glob("examples/**/*.py")])
             if p.stem != "__init__" and re.search(rf"\b{p.stem}\b", text)]
    return "\n".join([text, *named])


def reasons(text: str) -> list[str]:
    """Why code ``text`` can behave differently on the two lines (empty: it cannot)."""
    text = runs(text)
    out = [why for pattern, why in LINE_SENSITIVE.items() if re.search(pattern, text)]
    out += [f"{module} branches on the release ({', '.join(sorted(names))})"
            for module, names in version_branching_modules().items()
            if mentions(text, module, names)]
    return out


def code_of_tests(source: str) -> dict[str, str]:
    """``{test function: its code}`` for a test file's ``source`` (see the module docstring)."""
    tree = ast.parse(source)
    tops = _tops(tree)
    rows = source.splitlines()
    text = lambda node: "\n".join(rows[node.lineno - 1:node.end_lineno])  # noqa: E731
    imports = [" ".join(text(n).split()) for n in tree.body
               if isinstance(n, ast.Import | ast.ImportFrom)]
    out = {}
    for name, node in tops.items():
        if not (isinstance(node, ast.FunctionDef) and name.startswith("test_")):
            continue
        seen, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n in tops and n not in seen:
                seen.add(n)
                todo += _refs(tops[n])
        nodes = {id(tops[n]): tops[n] for n in seen}.values()
        code = "\n".join(text(n) for n in nodes)
        words = set(re.findall(r"\w+", code))
        used = [line for line in imports
                if words & set(re.findall(r"\w+", line.split(" import ", 1)[-1]))]
        out[name] = "\n".join([*used, code])
    return out


@functools.cache
def both_lines(path: Path) -> dict[str, tuple[str, ...]]:
    """``{test function: reasons}`` for the tests of ``path`` that run on both lines."""
    found = {}
    for name, code in code_of_tests(path.read_text()).items():
        why = reasons(code)
        if why:
            found[name] = tuple(why)
    return found
