"""Which test files `make test` runs on the torch_xla 2.8 line too: the rule, checked.

`make test` runs every test file on the 2.9 line (Colab's) and, on the 2.8 line (Kaggle's),
every notebook (in the platform run) plus only the files marked ``both_lines`` (a
``pytestmark`` line). A file carries the mark exactly when its text (the code it runs in
subprocesses included, and the benchmarks and examples it names) touches something whose
behaviour the torch_xla line can change:

* one of :data:`LINE_SENSITIVE`: code we do not control that calls torch_xla (Lightning,
  transformers/accelerate, jax/torchax/flax), a torch_xla API that differs between 2.8 and 2.9
  or whose use we know the lines treat differently (each entry says where that is written
  down), torch_xla's private C API;
* a toolkit or course module with a version branch, found in its code
  (:func:`version_branching_modules`: it compares with a release string such as ``"2.8"``,
  reads a ``__version__`` or a package's installed version).

Everything else (our own Python: samplers, ordering, checkpoint files, data checks, notebook
format, the training loop's logic) runs the same torch_xla calls on both lines as the
notebooks do, and the notebooks run on both. The check goes both ways: an unmarked file that
matches fails here, and so does a marked file that no longer matches anything (the set shrinks
when the code does). `make test-2.8` alone still runs every file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

TESTS = REPO / "tests"

#: pattern -> why a test that matches it can behave differently on 2.8 and 2.9
LINE_SENSITIVE = {
    r"\b(import|from) (lightning|pytorch_lightning)\b|\btpu_lightning\b":
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
        "(tpu_helpers/spmd.py)",
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


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def version_branching_modules() -> dict[str, set[str]]:
    """Toolkit and course modules that branch on the release: ``{module: names}``, the names
    being the module's top-level functions, classes and constants that hold a release as a
    value (``"2.8"``, ``"2.9"``: a key, a member, a comparison) or use one that does."""
    found = {}
    for path in sorted([*REPO.glob("tpu_helpers/*.py"), *REPO.glob("course/*.py")]):
        tops = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                tops[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        tops[target.id] = node
        names = {name for name, node in tops.items() if any(
            isinstance(c, ast.Constant) and isinstance(c.value, str) and RELEASE.match(c.value)
            for c in ast.walk(node))}
        while True:  # and what uses them, inside the module
            more = {name for name, node in tops.items() if name not in names
                    and _names(node) & names}
            if not more:
                break
            names |= more
        if names:
            found[f"{path.parent.name}.{path.stem}"] = names
    return found


def mentions(text: str, module: str, names: set[str]) -> bool:
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


def reasons(path: Path, branching: dict[str, set[str]]) -> list[str]:
    text = runs(path.read_text())
    out = [why for pattern, why in LINE_SENSITIVE.items() if re.search(pattern, text)]
    out += [f"{module} branches on the release ({', '.join(sorted(names))})"
            for module, names in branching.items() if mentions(text, module, names)]
    return out


def marked(path: Path) -> bool:
    return bool(re.search(r"^pytestmark\s*=.*\bboth_lines\b", path.read_text(), re.MULTILINE))


def test_a_file_runs_on_both_lines_exactly_when_it_touches_what_the_line_changes():
    branching = version_branching_modules()
    wrong = []
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue  # this file names the patterns
        why = reasons(path, branching)
        if why and not marked(path):
            wrong.append(f"{path.name}: add `pytestmark = pytest.mark.both_lines` ({why[0]})")
        elif marked(path) and not why:
            wrong.append(f"{path.name}: marked both_lines but touches nothing LINE_SENSITIVE "
                         "lists nor a version-branching module: drop the mark")
    assert not wrong, "\n".join(wrong)


def test_the_version_branches_are_found_in_the_code():
    branching = version_branching_modules()
    # the ones known today: the matched sets, the companion pins, the cache's release check
    assert {"tpu_helpers.env", "course.setup", "course.compile_cache"} <= set(branching), branching
    assert {"SUPPORTED", "matched_set"} <= branching["tpu_helpers.env"]
    assert mentions("from tpu_helpers import data, env\nenv.matched_set()", "tpu_helpers.env",
                    {"matched_set"})
    assert not mentions("from tpu_helpers.env import configure_emulation\n", "tpu_helpers.env",
                        {"matched_set"})
