"""The jax lane itself (``make test-jax``; ``scripts/jax_lane``): it must fail a notebook that only
passes without jax, and a notebook whose processes ran without jax on their path.

The lane runs pytest with ``-p jax_lane`` and the overlay on PYTHONPATH; here a pytest in a fresh
process does the same on small notebooks written for the test, with real kernels, real
torch_xla and real jax. Those runs need the overlay, so they run inside the lane only
(``JAX_LANE=1``); the rule that reads the proof files is checked everywhere.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "jax_lane"))
from jax_lane import verdict, without_jax  # noqa: E402

pytestmark = pytest.mark.one_line  # in the main lines: the pure rule only (once); the lane runs all

IN_LANE = os.environ.get("JAX_LANE") == "1"

KERNEL = {"pid": 1, "argv": ["python", "-m", "ipykernel_launcher", "-f"],
          "jax_origin": "/overlay/jax/__init__.py", "jax_version": "0.7.2"}


def test_the_proof_rule_needs_the_kernel_and_jax_in_every_process():
    child = {"pid": 2, "argv": ["python", "-c", "work"], "jax_origin": "/overlay/jax/__init__.py"}
    assert verdict([KERNEL, child]) is None
    assert "no proof file from the notebook's kernel" in verdict([child])
    assert "no proof file from the notebook's kernel" in verdict([])
    lost = {**child, "jax_origin": None}
    assert ("jax was not importable in 1 process(es): pid 2 python -c work"
            in verdict([KERNEL, lost]))
    assert "jax was not importable" in verdict([{**KERNEL, "jax_origin": None}])
    # a notebook the lane runs without jax (JAX_LANE_WITHOUT: Lightning's) must not have had it
    assert without_jax([{**KERNEL, "jax_origin": None}, {**lost}]) is None
    assert "jax was importable in 1 process(es)" in without_jax([KERNEL, lost])


SAVE = """import tempfile
import numpy as np
import torch
import torch.distributed.checkpoint as dist_cp
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

xr.use_spmd()
mesh = xs.Mesh(np.arange(1), (1,), ("fsdp",))
w = torch.ones(4, 4, device=torch_xla.device())
xs.mark_sharding(w, mesh, ("fsdp", None))
dist_cp.save({"w": w}, storage_writer=WRITER, planner=SPMDSavePlanner(), no_dist=True)
print("saved")"""

CHILD = """import os, subprocess, sys
lane = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p.endswith(("jax_lane", "lanes"))]
env = {**os.environ, "PYTHONPATH": os.pathsep.join(lane)}  # the overlay dropped
subprocess.run([sys.executable, "-c", "print('child')"], env=env, check=True)"""

NOTEBOOKS = {  # name: (source, passes the lane)
    "breaks_with_jax": (SAVE.replace("WRITER", "dist_cp.FileSystemWriter(tempfile.mkdtemp())"),
                        False),
    "fixed_writer": (SAVE.replace(
        "WRITER", "dist_cp.FileSystemWriter(tempfile.mkdtemp(), per_thread_copy_ahead=0)"), True),
    "child_without_jax": (CHILD, False),
}


def write_notebooks(folder: Path) -> None:
    for name, (source, _) in NOTEBOOKS.items():
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(source)]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, folder / f"{name}.ipynb")


def pytest_on(folder: Path, env: dict, *args: str) -> tuple[dict[str, str], str]:
    """Run pytest --nbmake on the notebooks in ``folder``; each notebook's outcome and the log."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=300",
                           "-p", "no:cacheprovider", "-rA", "-q", *args, *sorted(
                               str(p) for p in folder.glob("*.ipynb"))],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    outcomes = {m.group(2): m.group(1) for m in
                re.finditer(r"^(PASSED|FAILED|ERROR) \S*?(\w+)\.ipynb", log, re.MULTILINE)}
    return outcomes, log


@pytest.mark.skipif(not IN_LANE, reason="runs in the jax lane only (make test-jax): needs its "
                                        "overlay on PYTHONPATH")
@pytest.mark.skipif(importlib.metadata.version("torch_xla").startswith("2.8"),
                    reason="the lane's plugin is ours, the same on both lines: this self-test "
                    "runs in the 2.9 platform run; the torchax failure it provokes is pinned on "
                    "both lines by tests/test_jax_paths.py")
def test_the_lane_fails_a_notebook_that_only_passes_without_jax(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    write_notebooks(books)
    base = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    lane, log = pytest_on(books, {**base, "JAX_LANE_DIR": str(tmp_path / "proof")},
                          "-p", "jax_lane")
    print(log[-4000:])
    assert lane == {"breaks_with_jax": "FAILED", "fixed_writer": "PASSED",
                    "child_without_jax": "FAILED"}, log[-4000:]
    assert "'torchax.device_module' has no attribute 'current_stream'" in log
    assert re.search(r"child_without_jax.ipynb: the jax lane did not run with jax: jax was not "
                     r"importable in 1 process\(es\)", log), log[-4000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "proof").glob("*/*.json")]
    took = [r for r in records if "torchax" in r.get("imported", [])]
    assert took and all(r["privateuse1"] == "jax" for r in took)   # the path jax opens ran

    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and "jax" not in Path(p).name]   # neither the overlay nor the plugin
    plain = {k: v for k, v in base.items() if k not in ("JAX_LANE", "JAX_LANE_DIR")}
    without, log = pytest_on(books, {**plain, "PYTHONPATH": os.pathsep.join(keep)},
                             "-k", "breaks_with_jax")
    assert without == {"breaks_with_jax": "PASSED"}, log[-4000:]   # passes without jax
