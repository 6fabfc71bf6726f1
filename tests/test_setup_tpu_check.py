"""The setup's TPU check: it opens the TPU in a child process, names the fix, never hangs.

There is no TPU here, so the child is pointed at runtimes that fail the way a TPU host can:
``PJRT_DEVICE=TPU`` with no libtpu (what this machine really does), a stand-in libtpu built
here whose PJRT API version does not match torch_xla's (torch_xla's own check refuses it), and
one that never answers. Without a TPU the setup says what it could not check.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_python
from test_env import fake_dists

from course import setup
from tpu_helpers import env

#: The supported line installed here (2.9 in .venv, 2.8 in .venv-2.8), as in test_env.
HERE = env.matched_set(env.installed("torch"), env.installed("torch_xla"))
#: A stand-in for libtpu.so: GetPjrtApi returns a PJRT_Api of another major version, or hangs.
FAKE_LIBTPU = r"""
#include <stddef.h>
#include <stdlib.h>
#include <unistd.h>
typedef struct { size_t struct_size; void* ext; int major_version; int minor_version; } Version;
typedef struct { size_t struct_size; void* ext; Version version; void* functions[512]; } Api;
static Api api;
const Api* GetPjrtApi(void) {
  if (getenv("FAKE_LIBTPU_HANG")) sleep(100000);
  api.struct_size = sizeof(Api);
  api.version.struct_size = sizeof(Version);
  api.version.major_version = 1;  /* torch_xla 2.8 / 2.9 speak PJRT API 0.x */
  return &api;
}
"""


@pytest.fixture
def fake_libtpu(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libtpu")
    (tmp_path / "fake_libtpu.c").write_text(FAKE_LIBTPU)
    lib = tmp_path / "fake_libtpu.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "fake_libtpu.c")],
                   check=True, capture_output=True)
    return lib


def _processes_using(lib: Path) -> list[str]:
    """Processes whose environment points TPU_LIBRARY_PATH at ``lib``."""
    mark = f"TPU_LIBRARY_PATH={lib}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(environ.parent.name)
        except OSError:  # gone, or not ours
            continue
    return found


def test_without_a_tpu_the_setup_says_what_it_cannot_see():
    proc = run_python("from course.setup import setup_notebook\nsetup_notebook()")
    assert setup.NO_TPU_CHECK in proc.stdout, proc.stdout
    assert "libtpu / PJRT API mismatch shows only on a TPU" in setup.NO_TPU_CHECK
    assert "XLA:CPU device" in setup.verify_environment.__doc__  # the library check says so too


def test_the_tpu_check_here_fails_fast_and_names_the_fix():
    start = time.monotonic()
    problems = setup.check_tpu_opens(timeout=120)  # PJRT_DEVICE=TPU, and no libtpu here
    took = time.monotonic() - start
    assert len(problems) == 1 and took < 120, (problems, took)
    (problem,) = problems
    assert problem.startswith("The TPU did not open in a child process (PJRT_DEVICE=TPU")
    assert "libtpu could not be loaded (OSError: libtpu not found)" in problem, problem
    assert f"`pip install libtpu=={HERE.libtpu}` and restart the runtime" in problem, problem


def test_the_tpu_check_names_a_pjrt_api_mismatch(fake_libtpu):
    (problem,) = setup.check_tpu_opens({"TPU_LIBRARY_PATH": str(fake_libtpu)}, timeout=120)
    assert "a PJRT API mismatch: this libtpu was not built for this torch_xla" in problem
    assert "Mismatched PJRT plugin PJRT API major version (1)" in problem, problem
    assert f"torch_xla[tpu]=={HERE.torch_xla[0]} pins libtpu=={HERE.libtpu}" in problem


def test_the_tpu_check_stops_a_tpu_that_never_answers(fake_libtpu):
    start = time.monotonic()
    (problem,) = setup.check_tpu_opens({"TPU_LIBRARY_PATH": str(fake_libtpu),
                                        "FAKE_LIBTPU_HANG": "1"}, timeout=8)
    took = time.monotonic() - start
    assert 8 <= took < 28, took
    assert problem.startswith("The TPU did not open within 8 s in a child process"), problem
    assert "Restart the runtime" in problem and f"pip install libtpu=={HERE.libtpu}" in problem
    assert not _processes_using(fake_libtpu)  # the child was stopped, not left holding a TPU


def test_setup_on_a_tpu_host_stops_with_the_fix_and_leaves_the_kernel_unopened(
        tmp_path, fake_libtpu):
    site = fake_dists(tmp_path / "site", {"libtpu": HERE.libtpu})  # the pinned libtpu, "installed"
    proc = run_python(
        """
        from course.setup import setup_notebook
        from tpu_helpers.env import EnvironmentProblem, runtime_initialized
        try:
            setup_notebook()
        except EnvironmentProblem as exc:
            print("PROBLEM:", exc)
        print("KERNEL OPENED XLA:", runtime_initialized())
        """,
        env={"PYTHONPATH": str(site), "TPU_ACCELERATOR_TYPE": "v5litepod-1",
             "PJRT_DEVICE": "", "TPU_LIBRARY_PATH": str(fake_libtpu)}, timeout=300)
    problem = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBLEM:"))
    assert "The TPU did not open in a child process" in problem and "PJRT API mismatch" in problem
    assert f"pip install libtpu=={HERE.libtpu}" in problem, problem
    assert "KERNEL OPENED XLA: False" in proc.stdout
