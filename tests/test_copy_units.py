"""A user copies a toolkit unit into their own project: it must work there alone.

Each script in ``tests/copy_units/`` names on its first line the toolkit files a user copies
(``# copies: data.py``: a unit is one file or a declared pair; tpu_lightning.py is a unit
of three, train.py of four). The test copies
exactly those files into a temporary folder outside the repository and runs the script there
in a fresh Python with the repository off ``sys.path`` and ``tpu_helpers`` and ``course`` made
unimportable (so a hidden import of anything else fails), on XLA:CPU. The script prints
``ok`` last. Every module in ``tpu_helpers/`` must be copied by at least one script.
"""

from __future__ import annotations

import re
import shutil
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


def copied_files(script: Path) -> list[str]:
    first = script.read_text().splitlines()[0]
    assert first.startswith("# copies: "), f"{script.name}: first line must be '# copies: ...'"
    return first.removeprefix("# copies: ").split()


SCRIPTS = sorted(UNITS.glob("*.py"))
#: The units of more than two files: Lightning's checkpoint IO needs checkpoint.py (atomic
#: writes, safe loads) and its prediction writer needs ordering.py (the rank-file format and the
#: exactly-once merge shared with predict.py); train.py's checkpoints need checkpoint.py, its
#: loaders are data.py's (one make_train_loader, one make_eval_loader in the toolkit) and it
#: runs fit on every replica with launch.py (which is a unit alone: your own loop, no fit).
LARGER_UNITS = {"tpu_lightning": 3, "train": 4}


def test_every_toolkit_module_is_a_tested_copy_unit():
    covered = {f for s in SCRIPTS for f in copied_files(s)}
    modules = {p.name for p in (REPO / "tpu_helpers").glob("*.py")} - {"__init__.py"}
    for script in SCRIPTS:
        most = LARGER_UNITS.get(script.stem, 2)
        assert len(copied_files(script)) <= most, f"{script.name}: a unit is one file or a pair"
    assert modules <= covered, f"no copy-unit script copies {sorted(modules - covered)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_unit_works_copied_alone(script, tmp_path):
    project = tmp_path / "your_project"
    project.mkdir()
    for name in copied_files(script):
        shutil.copy(REPO / "tpu_helpers" / name, project / name)
    code = BLOCK_REPO.format(repo=str(REPO)) + script.read_text()
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True,
                          text=True, timeout=300,
                          env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                               "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"


def test_the_readme_states_each_units_lines_and_the_total():
    """The README's unit table and toolkit total are the files' line counts (wc -l)."""
    readme = (REPO / "README.md").read_text()
    lines = {p.name: len(p.read_text().splitlines()) for p in (REPO / "tpu_helpers").glob("*.py")}
    rows = dict(re.findall(r"^\| `(\w+\.py)` \| (\d+) \|", readme, re.M))
    assert rows and {name: lines[name] for name in rows} == {k: int(v) for k, v in rows.items()}
    total = sum(n for name, n in lines.items() if not name.startswith("doctor"))
    assert f"({total:,} lines in {len(lines) - 3}\nmodules and `__init__.py`" in readme
