"""Kaggle with Internet off: the wheels dataset (scripts/kaggle_dataset.py) and the setup cell
that installs from it, with real pip, real wheels and a package index that refuses everything.

The setup cell runs in an IPython shell in a fresh venv that sees this venv's packages
(torch, torch_xla, IPython, pip, ...) through a folder of links, minus this repository's package
and minus :data:`FROM_FOLDER`; ``PIP_INDEX_URL`` points at a local server that answers 403 to
every request (and counts them), pip's configuration files are switched off, and the folder is
the only other source. So whatever the venv imports afterwards from its own site-packages came
from the folder.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import kaggle_dataset  # scripts/, on the path via conftest
import notebook_template as tpl
import pytest
from conftest import venv_without_us

from course import setup

pytestmark = pytest.mark.one_line  # pip and the setup cell only; no torch_xla API

REPO = Path(__file__).resolve().parent.parent
#: Notebook packages the test venv lacks, so the setup must take them from the folder.
FROM_FOLDER = ("psutil", "transformers", "accelerate")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: Runs the setup cell argv[2] times in one IPython shell; prints a JSON report last.
DRIVER = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
runs = [shell.run_cell(sys.argv[1]) for _ in range(int(sys.argv[2]))]
report = {"ok": [r.success for r in runs], "error": repr(runs[-1].error_in_exec)}
if all(report["ok"]):
    import accelerate, course.setup, psutil, transformers
    report.update({m.__name__: m.__file__ for m in (course.setup, psutil, transformers,
                                                     accelerate)},
                  versions=[transformers.__version__, accelerate.__version__])
print(json.dumps(report))
"""


class _Refuse(http.server.BaseHTTPRequestHandler):
    """A package index that answers 403 to everything, counting the requests."""

    hits: list[str] = []

    def _refuse(self) -> None:
        type(self).hits.append(f"{self.command} {self.path}")
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _refuse

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def refusing_index():
    _Refuse.hits = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", _Refuse.hits
    server.shutdown()
    server.server_close()


def _pip_env(**extra: str) -> dict[str, str]:
    """This process's environment without pip's configuration, PYTHONPATH or our variables."""
    drop = ("PYTHONPATH", "TPU_NB_DATA", "TPU_NB_SOURCE", "TPU_NB_WHEELS", "PIP_FIND_LINKS",
            "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def _from_folder(name: str) -> bool:
    low = name.lower().replace("-", "_")
    return any(low == p or low.startswith(f"{p}_") for p in FROM_FOLDER)


def _new_venv(tmp_path_factory) -> Path:
    """A fresh venv seeing this venv's packages except ours and :data:`FROM_FOLDER`."""
    return venv_without_us(tmp_path_factory.mktemp("offline"), hide=_from_folder)


@pytest.fixture
def venv(tmp_path_factory) -> Path:
    return _new_venv(tmp_path_factory)


@pytest.fixture(scope="module")
def own_wheel(tmp_path_factory) -> Path:
    return kaggle_dataset.build_wheel(tmp_path_factory.mktemp("own"))


def _visible(python: Path) -> list[str]:
    """Every distribution the venv sees (what the folder need not carry)."""
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; print(json."
                          "dumps(sorted({d.metadata['Name'] for d in m.distributions()})))"],
                         capture_output=True, text=True, check=True, env=_pip_env()).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, own_wheel) -> Path:
    """The dataset folder, built by the builder for this Python from the package index (as
    `make kaggle-dataset` does for Kaggle's), leaving out what the test venv already has."""
    out = tmp_path_factory.mktemp("dataset") / "tpu-notebooks-wheels"
    visible = _visible(_new_venv(tmp_path_factory))
    assert not {setup._norm(d) for d in visible} & set(FROM_FOLDER)
    kaggle_dataset.build(out, owner="someone", reqs=list(setup.NOTEBOOK_PACKAGES.values()),
                         python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
                         platforms=(), provided=(*kaggle_dataset.PLATFORM, *visible),
                         wheel=own_wheel)
    return out


def _drive(python: Path, cwd: Path, env: dict[str, str], runs: int = 1, timeout: float = 300):
    start = time.monotonic()
    proc = subprocess.run([str(python), "-c", DRIVER, tpl.setup_cell(), str(runs)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    out = _ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out, time.monotonic() - start


@pytest.mark.slow
def test_the_setup_cell_installs_everything_from_the_folder_with_the_index_refused(
        venv, folder, refusing_index, tmp_path):
    index, hits = refusing_index
    env = _pip_env(PIP_INDEX_URL=f"{index}/simple", KAGGLE_KERNEL_RUN_TYPE="Interactive",
                   TPU_NB_WHEELS=str(folder / "tpu_helpers-*.whl"),
                   TPU_NB_SOURCE=f"{index}/tpu_helpers-0.1.0-py3-none-any.whl")
    report, out, _ = _drive(venv, tmp_path, env, runs=2)
    assert report["ok"] == [True, True], out[-4000:]
    site = str(venv.parent.parent)
    for module in ("course.setup", *FROM_FOLDER):
        assert report[module].startswith(site), (module, report[module])  # from the folder
    assert report["versions"] == ["5.24.0", "1.15.0"]
    assert f"From the wheels in {folder} only (no package index)" in out
    assert out.count("Notebook packages it lacks") == 1  # the second run installs nothing
    assert hits == []  # pip never asked the index; the folder's presence needs no probe


def test_without_the_folder_the_setup_says_what_to_attach_and_does_not_hang(
        venv, refusing_index, tmp_path):
    index, hits = refusing_index
    env = _pip_env(PIP_INDEX_URL=f"{index}/simple", KAGGLE_KERNEL_RUN_TYPE="Interactive",
                   TPU_NB_WHEELS=str(tmp_path / "nothing" / "tpu_helpers-*.whl"),
                   PYTHONPATH=str(REPO))  # the package is there, the notebook packages not
    report, out, seconds = _drive(venv, tmp_path, env, timeout=120)
    assert report["ok"] == [False] and "EnvironmentProblem" in report["error"]
    assert setup.ATTACH in out and "Add Input" in out and setup.WHEELS_DATASET in out
    assert hits == ["HEAD /simple/pip/"]  # one probe, refused; pip never ran
    assert seconds < 60, seconds


def test_without_the_folder_or_the_package_the_cell_names_the_dataset(
        venv, refusing_index, tmp_path):
    index, hits = refusing_index
    env = _pip_env(PIP_INDEX_URL=f"{index}/simple", KAGGLE_KERNEL_RUN_TYPE="Interactive",
                   TPU_NB_WHEELS=str(tmp_path / "nothing" / "tpu_helpers-*.whl"),
                   TPU_NB_SOURCE=f"{index}/tpu_helpers-0.1.0-py3-none-any.whl")
    report, out, seconds = _drive(venv, tmp_path, env, timeout=120)
    assert report["ok"] == [False]
    assert report["error"] == "ModuleNotFoundError(\"No module named 'course'\")"
    assert "403" in out  # pip's own reason
    # the traceback shows the line above the failing one: the dataset and how to attach it
    assert f"# failed? Kaggle: Internet on, or Add Input > dataset {tpl.WHEELS_DATASET}" in out
    assert seconds < 60, seconds


def test_the_builder_resolves_a_closure_for_the_target_and_leaves_the_platform_out(tmp_path):
    """scripts/kaggle_dataset.py on small real wheels from a local folder (no index): markers
    evaluated for the target Python, extras followed, torch never downloaded."""
    src, local = tmp_path / "src", tmp_path / "local"
    projects = {
        "kd-top": ['kd-dep>=1.0', 'torch>=2.0', 'kd-extra[fast]',
                   'kd-win; sys_platform == "win32"', 'kd-old; python_version < "3.9"'],
        "kd-dep": [], "kd-extra": {"fast": ["kd-speed"]}, "kd-speed": [], "kd-win": [],
        "kd-old": [],
    }
    for name, deps in projects.items():
        d = src / name
        d.mkdir(parents=True)
        extras = deps if isinstance(deps, dict) else {}
        toml = (f'[project]\nname = "{name}"\nversion = "1.0"\n'
                f'dependencies = {json.dumps(deps if isinstance(deps, list) else [])}\n'
                + ("[project.optional-dependencies]\n"
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in extras.items())
                   if extras else "")
                + f'[tool.setuptools]\npy-modules = ["{name.replace("-", "_")}"]\n')
        (d / "pyproject.toml").write_text(toml)
        (d / f"{name.replace('-', '_')}.py").write_text("")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(local), *map(str, src.iterdir())],
                   check=True, capture_output=True, env=_pip_env(), timeout=300)
    own = next(iter(local.glob("kd_dep-*.whl")))  # stands in for this package's wheel here
    out = tmp_path / "dataset"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "kaggle_dataset.py"), str(out),
         "--owner", "someone", "--wheel", str(own), "--requirement", "kd-top",
         "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
         "--platform", "any", "--no-index", "--find-links", str(local)],
        capture_output=True, text=True, env=_pip_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name.split("-")[0] for p in out.glob("*.whl"))
    assert names == ["kd_dep", "kd_extra", "kd_speed", "kd_top"]  # no torch, win or old
    meta = json.loads((out / "dataset-metadata.json").read_text())
    assert meta["id"] == f"someone/{setup.WHEELS_DATASET}" and meta["title"]
    assert meta["licenses"] == [{"name": kaggle_dataset.LICENSE}]
    with zipfile.ZipFile(next(out.glob("kd_top-*.whl"))) as zf:
        assert any(n.endswith("METADATA") for n in zf.namelist())


def test_the_default_dataset_is_for_kaggles_python_without_the_platform():
    reqs = kaggle_dataset.requirements()
    assert set(setup.NOTEBOOK_PACKAGES.values()) <= set(reqs)
    assert "transformers>=5.24.0" in reqs and "numpy" in reqs  # the package's own deps too
    assert kaggle_dataset.KAGGLE_PYTHON == "3.12"  # Kaggle/docker-python tpu/config.txt
    config = (Path(__file__).parent / "data" / "kaggle-tpu-packages.txt").read_text()
    assert "PYTHON_WHEEL_VERSION=cp312" in config
    assert {"torch", "torch-xla", "libtpu", "jax"} <= set(kaggle_dataset.PLATFORM)


def test_the_template_and_course_setup_name_the_same_dataset():
    assert tpl.WHEELS_DATASET == setup.WHEELS_DATASET
    assert (tpl.WHEELS_VAR, tpl.WHEELS_GLOB) == (setup.WHEELS_VAR, setup.WHEELS_GLOB)
    assert f'"{setup.WHEELS_VAR}", "{setup.WHEELS_GLOB}"' in tpl.setup_cell()
