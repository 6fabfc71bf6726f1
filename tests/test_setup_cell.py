"""The notebooks' setup cell, run for real in an IPython shell (the `%pip` line is IPython).

Where ``tpu_helpers`` is not importable (as on Colab or Kaggle) the cell pip-installs this
repository's package from ``$TPU_NB_SOURCE``: here a wheel and a folder, into a throwaway venv
that sees this venv's packages (torch, torch_xla, IPython, pip) through a folder of links which
leaves out this venv's own editable ``tpu_helpers``. The default source, the GitHub URL, needs
GitHub, which the test machine cannot reach: pip takes a ``git+https`` URL the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import notebook_template as tpl  # scripts/, on the path via conftest
import pytest
from conftest import venv_without_us

pytestmark = pytest.mark.one_line  # pip-installs this package with --no-deps: no torch_xla API

REPO = Path(__file__).resolve().parent.parent

#: Runs the setup cell ``argv[2]`` times in one IPython shell, counting `%pip` runs; prints a
#: JSON report on its last line.
DRIVER = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
pips, magic = [], shell.run_line_magic
shell.run_line_magic = lambda name, line, *a, **k: (
    pips.append(line) if name == "pip" else None, magic(name, line, *a, **k))[1]
runs = [shell.run_cell(sys.argv[1]) for _ in range(int(sys.argv[2]))]
report = {"ok": [r.success for r in runs], "pips": len(pips),
          "error": repr(runs[-1].error_in_exec), "torch_xla": "torch_xla" in sys.modules}
if all(report["ok"]):
    import course.setup
    from course.datasets import data_dir, load_digits
    report.update(course=course.setup.__file__, data=str(data_dir()),
                  digits=list(load_digits("train")[0].shape),
                  runtime=type(shell.user_ns["RUNTIME"]).__name__)
print(json.dumps(report))
"""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _drive(python: Path | str, cwd: Path, env: dict[str, str], runs: int = 1):
    proc = subprocess.run([str(python), "-c", DRIVER, tpl.setup_cell(), str(runs)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)
    out = _ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


@pytest.fixture
def venv(tmp_path_factory) -> Path:
    """A new venv without tpu_helpers that sees this venv's other packages; returns its python."""
    return venv_without_us(tmp_path_factory.mktemp("setup-cell"))


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """A folder holding what pip needs of the repository (as a user's copy would)."""
    dst = tmp_path_factory.mktemp("copy") / "tpu-notebooks"
    dst.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dst / name)
    for name in ("tpu_helpers", "course", "data"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _env(source: str | Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TPU_NB_DATA")}
    return {**env, "TPU_NB_SOURCE": str(source), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "TPU_NB_WHEELS": "/nonexistent/tpu_helpers-*.whl"}  # no wheels dataset attached


def _installed_and_ran(report: dict, python: Path) -> None:
    site = str(python.parent.parent)
    assert report["ok"] == [True, True] and report["pips"] == 1  # a re-run installs nothing
    assert report["course"].startswith(site) and report["data"].startswith(site)
    assert report["digits"] == [1437, 1, 8, 8] and report["runtime"] == "Runtime"


@pytest.mark.slow
def test_setup_cell_installs_a_wheel_then_installs_nothing_on_a_rerun(venv, copy, tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp_path / "dist"), str(copy)], check=True, capture_output=True,
                   timeout=600)
    (wheel,) = (tmp_path / "dist").glob("tpu_helpers-*.whl")
    report, out = _drive(venv, tmp_path, _env(wheel), runs=2)
    _installed_and_ran(report, venv)
    assert "no TPU attached" in out and "Warning" not in out


@pytest.mark.slow
def test_setup_cell_installs_from_a_folder(venv, copy, tmp_path):
    report, out = _drive(venv, tmp_path, _env(copy), runs=2)
    _installed_and_ran(report, venv)
    assert "Warning" not in out  # the build prints nothing (pyproject.toml, test_wheel.py)


def test_setup_cell_failure_shows_pips_error_and_what_to_do(venv, tmp_path):
    report, out = _drive(venv, tmp_path, _env(tmp_path / "tpu_helpers-0.1.0-py3-none-any.whl"))
    assert report["ok"] == [False] and report["pips"] == 1
    assert report["error"] == "ModuleNotFoundError(\"No module named 'course'\")"
    assert "ERROR:" in out  # pip's own reason
    # the traceback shows the lines above the failing one, with the way out
    assert (f"# failed? Kaggle: Internet on, or Add Input > dataset {tpl.WHEELS_DATASET} "
            "(README: Internet off)") in out


def test_setup_cell_installs_nothing_where_the_package_is_importable():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TPU_NB_SOURCE": "/nonexistent.whl"}
    report, out = _drive(sys.executable, REPO, env)
    assert report["ok"] == [True] and report["pips"] == 0, out[-3000:]
    assert report["course"] == str(REPO / "course" / "setup.py")
    assert not report["torch_xla"]  # the setup never starts torch_xla in the kernel


def test_setup_cell_is_short():
    # 8 lines before Kaggle with Internet off (the wheels glob, its import, the comment)
    assert len(tpl.setup_cell().splitlines()) <= 11 == tpl.MAX_SETUP_LINES
