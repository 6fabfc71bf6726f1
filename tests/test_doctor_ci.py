"""Where users run the doctor's static pass besides their terminal (issue 37): the pre-commit hook
this repository defines (``.pre-commit-hooks.yaml``), tried for real with ``pre-commit try-repo``,
and the example GitHub Actions workflow (``examples/ci/tpu-doctor.yml``), whose command lines run
here against a repository holding a faulty script and notebook."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import notebook_template as tpl  # scripts/ (repository tooling), on the path via conftest
import pytest
import yaml
from conftest import REPO
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

pytestmark = pytest.mark.one_line  # the static pass imports no torch_xla (a test checks it)

HOOKS = REPO / ".pre-commit-hooks.yaml"
WORKFLOW = REPO / "examples" / "ci" / "tpu-doctor.yml"
FAULTY = """import torch_xla
import torch_xla.core.xla_model as xm


def train(index):
    print(xm.xrt_world_size())


torch_xla.launch(train, nprocs=8)
"""


def project(folder: Path, faulty: bool) -> list[str]:
    """A fresh git repository with a script and a notebook (both faulty, or both clean): their
    names, added to the index."""
    folder.mkdir()
    code = FAULTY if faulty else FAULTY.replace("xm.xrt_world_size()", "1").replace(
        ", nprocs=8", "")
    (folder / "train.py").write_text(code)
    nb = new_notebook(cells=[new_markdown_cell("# Train"), new_code_cell("%pip install -q x\n"
                                                                        + code)])
    nbformat.write(nb, folder / "train.ipynb")
    (folder / "README.md").write_text("not checked\n")
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    subprocess.run(["git", "add", "."], cwd=folder, check=True)
    return ["train.py", "train.ipynb"]


def test_the_static_pass_imports_only_the_standard_library():
    """What lets the hook's environment (this package, no torch) and a --no-deps install work."""
    code = (f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport tpu_helpers.doctor\n"
            "print(*sorted({m.split('.')[0] for m in sys.modules} - {'__main__'}"
            " - set(sys.stdlib_module_names) - set(sys.builtin_module_names)))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                         check=True)  # -S: no site-packages at all
    assert out.stdout.split() == ["tpu_helpers"], out.stdout


def test_the_hook_definition():
    (hook,) = yaml.safe_load(HOOKS.read_text())
    assert {k: hook[k] for k in ("id", "entry", "language", "types_or")} == {
        "id": "tpu-doctor", "entry": "tpu-doctor --static", "language": "python",
        "types_or": ["python", "jupyter"]}
    assert 'tpu-doctor = "tpu_helpers.doctor:main"' in (REPO / "pyproject.toml").read_text()


@pytest.mark.slow
def test_pre_commit_try_repo_fails_a_faulty_script_and_notebook(tmp_path):
    """``pre-commit try-repo <this repository> tpu-doctor --files ...`` in a fresh repository:
    pre-commit builds the hook's virtualenv and installs this package from the package index's
    build tools (network), then runs the hook (~20 s here: try-repo builds it afresh on each
    call, so one call). The same command's exit status on a clean project (0) is checked in
    test_the_example_workflow_runs_the_static_pass."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed copy runs
    env["PRE_COMMIT_HOME"] = str(tmp_path / "cache")
    for faulty in (True,):
        folder = tmp_path / ("faulty" if faulty else "clean")
        files = project(folder, faulty)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(REPO),
                               "tpu-doctor", "--files", *files], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=900)
        print(f"pre-commit try-repo ({folder.name}): {time.perf_counter() - start:.1f} s")
        out = proc.stdout + proc.stderr
        if faulty:
            assert proc.returncode == 1 and "tpu-doctor (static pass)" in out, out[-3000:]
            assert "Failed" in out and "- exit code: 1" in out, out[-3000:]
            for finding in ("removed-api", "launch-nprocs", "== train.py ==",
                            "== train.ipynb ==", "cell 1 (index 1), line 7"):
                assert finding in out, (finding, out[-3000:])
        else:
            assert proc.returncode == 0 and "Passed" in out, out[-3000:]


def test_the_example_workflow_runs_the_static_pass(tmp_path):
    """Every ``run`` line of the workflow but the install runs here as GitHub runs it (bash -e -o
    pipefail), with ``tpu-doctor`` the console script pyproject.toml declares (a launcher that
    calls ``tpu_helpers.doctor:main``, as pip writes it)."""
    flow = yaml.safe_load(WORKFLOW.read_text())
    assert {"push", "pull_request"} <= set(flow.get("on", flow.get(True)))  # YAML 1.1: on = True
    (job,) = flow["jobs"].values()
    runs = [step["run"] for step in job["steps"] if "run" in step]
    install, commands = runs[0], runs[1:]
    url = f'"git+{tpl.REPO_URL}"'
    assert install == f"pip install --no-deps {url}" and url in (REPO / "README.md").read_text()
    assert commands and all("tpu-doctor --static" in c for c in commands)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tpu-doctor").write_text(f"#!{sys.executable}\nimport sys\n"
                                        "from tpu_helpers.doctor import main\nsys.exit(main())\n")
    (bin_dir / "tpu-doctor").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO)}
    for faulty in (True, False):
        folder = tmp_path / ("faulty" if faulty else "clean")
        project(folder, faulty)
        for command in commands:
            proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                                   command], cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=120)
            out = proc.stdout + proc.stderr
            assert "== train.py ==" in out and "== train.ipynb ==" in out, out
            assert "README" not in out and (proc.returncode != 0) == faulty, (proc.returncode, out)
            assert ("verdict: NOT READY" in out) == faulty, out
