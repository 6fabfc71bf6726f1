"""A user copies a toolkit unit into their own project: it must work there alone.

Each script in ``tests/copy_units/`` names on its first line the toolkit files a user copies
(``# copies: data.py``: a unit is one module or a declared pair, plus data files: the doctor's
rules; train.py is a unit of four, the doctor and Lightning's prediction writer units of
three). The test copies exactly those files into a temporary folder outside the repository
and runs the script there in a fresh Python with the repository off ``sys.path`` and
``tpu_helpers`` and ``course`` made unimportable (so a hidden import of anything else fails),
on XLA:CPU. The script prints ``ok`` last. Every module in ``tpu_helpers/`` must be copied by
at least one script.

A script whose fresh Python imports ``torch_xla`` before anything else runs (``WARM``: its
leading statements are imports that reach torch_xla, see ``imports_torch_xla_first``) runs
in a process forked, for it alone, from one Python that imported only ``torch`` and
``torch_xla`` (~4.5 s of CPU each time; the import starts no XLA runtime) and nothing from the
repository: at the script's first line of its own it is in the state a fresh Python reaches
after those imports, in the script's folder, with its own runtime. The others (some check what
their unit does not import) run in a fresh Python.
"""

from __future__ import annotations

import ast
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

UNITS = Path(__file__).with_name("copy_units")
BLOCK_REPO = """
import sys
sys.modules["tpu_helpers"] = None  # the repository's packages are out of reach
sys.modules["course"] = None
sys.path = [p for p in sys.path if p.rstrip("/") != {repo!r}]  # (its venv may live inside)
"""


#: The warm parent: imports torch and torch_xla (not the repository: its cwd is an empty folder,
#: no PYTHONPATH), then forks one child per request line ({code, cwd, home, out, err}); the
#: child runs ``code`` as ``python -c`` would (uncaught errors print and exit 1, at the
#: interpreter's own exit); the parent answers each line with the child's exit code.
WARM_PARENT = """
import json, os, sys
import torch, torch_xla
assert not set(json.loads(sys.argv[1])) & set(sys.modules), "the parent imported a toolkit module"
KEEP = {"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__",
        "__builtins__"}


def child(job, os=os, sys=sys, keep=KEEP):
    os.chdir(job["cwd"])  # sys.path[0] is '' as for python -c: the copy folder
    os.environ["HOME"] = job["home"]
    for fd, path in ((0, os.devnull), (1, job["out"]), (2, job["err"])):
        os.dup2(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC), fd)
    code = compile(job["code"], "<string>", "exec")
    main = sys.modules["__main__"].__dict__  # the script's globals: a bare __main__, as -c's
    for name in [name for name in main if name not in keep]:
        del main[name]
    exec(code, main)
    sys.exit(0)  # the ordinary interpreter exit; an uncaught error prints and exits 1


for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        child(json.loads(line))  # never returns
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def copied_files(script: Path) -> list[str]:
    first = script.read_text().splitlines()[0]
    assert first.startswith("# copies: "), f"{script.name}: first line must be '# copies: ...'"
    return first.removeprefix("# copies: ").split()


SCRIPTS = sorted(UNITS.glob("*.py"))
#: The units of more than two files: train.py's checkpoints need checkpoint.py, its loaders are
#: data.py's (one make_train_loader, one make_eval_loader in the toolkit) and it runs fit on
#: every replica with launch.py (which is a unit alone: your own loop, no fit). Lightning's
#: unit is a pair: its checkpoint IO needs checkpoint.py (atomic writes, safe loads). The doctor
#: is three: its static pass, the rules that pass inherits, and the --run pass with the catalogue
#: (which the --run child loads alone). Lightning's prediction writer is three: its rank files
#: are ordering.py's format and merge (the one predict.py uses), written with checkpoint.py's
#: atomic_write.
LARGER_UNITS = {"train": 4, "doctor": 3, "lightning_writer": 3}


def test_every_toolkit_module_is_a_tested_copy_unit():
    covered = {f for s in SCRIPTS for f in copied_files(s)}
    modules = {p.name for p in (REPO / "tpu_helpers").glob("*.py")} - {"__init__.py"}
    for script in SCRIPTS:
        most = LARGER_UNITS.get(script.stem, 2)
        py = [f for f in copied_files(script) if f.endswith(".py")]  # (+ data: the doctor's toml)
        assert len(py) <= most, f"{script.name}: a unit is one module or a pair"
    assert modules <= covered, f"no copy-unit script copies {sorted(modules - covered)}"


def imports_torch_xla_first(source: str, copied: dict[str, Path]) -> bool:
    """A fresh Python running ``source`` imports torch_xla before anything else runs: its
    leading statements are imports (of the standard library, torch or numpy, which a fresh
    ``import torch_xla`` loads anyway; of a copied module whose own leading statements import
    torch_xla first) and ``os.environ[...] = ...``, up to an import of torch_xla."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]).startswith("os.environ["):
            continue
        if isinstance(node, ast.Import):
            tops = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            tops = [node.module.split(".")[0]]
        else:
            return False
        for top in tops:
            if top == "torch_xla":
                return True
            if top in copied:
                return imports_torch_xla_first(copied[top].read_text(), copied)
            if top not in sys.stdlib_module_names and top not in ("torch", "numpy"):
                return False
    return False


WARM = [s.stem for s in SCRIPTS if imports_torch_xla_first(
    s.read_text(), {n.removesuffix(".py"): REPO / "tpu_helpers" / n for n in copied_files(s)})]


def test_warm_units_are_those_whose_script_imports_torch_xla_first():
    assert WARM == ["checkpoint", "device_loader", "hang_watchdog", "launch", "predict",
                    "pretrained", "sharded_checkpoint", "spmd", "train"]


@pytest.fixture(scope="module")
def warm_parent(tmp_path_factory):
    """The warm parent (``WARM_PARENT``), started once for this file; yields a function that
    runs code in a child of it and returns the child's exit code."""
    empty = tmp_path_factory.mktemp("warm-parent")
    names = [p.stem for p in (REPO / "tpu_helpers").glob("*.py")] + ["tpu_helpers", "course"]
    proc = subprocess.Popen([sys.executable, "-c", WARM_PARENT, json.dumps(names)], cwd=empty,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                                 "PATH": "/usr/bin:/bin", "HOME": str(empty)},
                            start_new_session=True)
    answers = selectors.DefaultSelector()
    answers.register(proc.stdout, selectors.EVENT_READ)

    def run(code: str, cwd: Path, home: Path, out: Path, err: Path, timeout: float) -> int:
        job = {"code": code, "cwd": str(cwd), "home": str(home), "out": str(out),
               "err": str(err)}
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        assert answers.select(timeout), f"no exit within {timeout} s"
        answer = proc.stdout.readline()
        assert answer.strip(), f"the warm parent died ({proc.wait()})"
        return int(answer)

    try:
        yield run
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent and any child left running
        proc.wait()


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_unit_works_copied_alone(script, tmp_path, request):
    project = tmp_path / "your_project"
    project.mkdir()
    for name in copied_files(script):
        shutil.copy(REPO / "tpu_helpers" / name, project / name)
    code = BLOCK_REPO.format(repo=str(REPO)) + script.read_text()
    if script.stem in WARM:
        out, err = tmp_path / "stdout", tmp_path / "stderr"
        run = request.getfixturevalue("warm_parent")
        returncode = run(code, project, tmp_path, out, err, timeout=300)
        stdout, stderr = out.read_text(), err.read_text()
    else:
        proc = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True,
                              text=True, timeout=300,
                              env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                                   "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert returncode == 0, stderr[-3000:]
    assert stdout.strip().splitlines()[-1] == "ok"


def test_the_readme_states_each_units_lines_and_the_total():
    """The README's unit table and toolkit total are the files' line counts (wc -l)."""
    readme = (REPO / "README.md").read_text()
    lines = {p.name: len(p.read_text().splitlines()) for p in (REPO / "tpu_helpers").glob("*.py")}
    rows = dict(re.findall(r"^\| `(\w+\.py)` \| (\d+) \|", readme, re.M))
    assert rows and {name: lines[name] for name in rows} == {k: int(v) for k, v in rows.items()}
    library = {name: n for name, n in lines.items() if not name.startswith("doctor")}
    total = sum(library.values())  # the doctor apart; `__init__.py` counted, not a module
    assert f"({total:,} lines in {len(library) - 1}\nmodules and `__init__.py`" in readme
