"""The template's time budget, enforced: nbmake runs each notebook as one test item, and a
notebook that takes longer than its budget fails, naming its time. The budget is the
notebook's own ``metadata.tpu_notebooks.budget_seconds`` (at most 90; 90 if it has none);
``TPU_NB_BUDGET=<seconds>`` overrides it for every notebook (e.g. on a loaded machine). With
``TPU_NB_CALIBRATE=1`` (``make test``) every budget is multiplied by how much slower than usual
this machine imports torch_xla in a fresh Python (:func:`machine_factor`, 1 to 4), printed in
the run's header.

It also fails a notebook whose executed output shows a learner a stderr line that
``scripts/stderr_allowlist.py`` does not explain (library banners, deprecation chatter,
interleaved rank output are noise), and with ``TPU_NB_EXECUTED=<folder>`` it writes each
executed copy there (``scripts/notebook_stats.py --executed`` reads them).

A pytest plugin loaded by ``-p scripts.notebook_budget`` (pyproject.toml's addopts), not a
conftest.py: a second conftest module would shadow ``tests/conftest.py`` for the tests'
``from conftest import ...``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbmake import pytest_items

from scripts.notebook_template import budget_seconds
from scripts.stderr_allowlist import unexplained

#: Wall seconds of a fresh ``python -I -c "import torch_xla"`` on this 2-core machine at its
#: normal speed (2.9: 7.2-9.8 s, 2.8: 11.7-12.0 s, measured 2026-11-29; the upper ends).
REFERENCE_IMPORT_S = {"2.9": 9.8, "2.8": 12.0}
MAX_FACTOR = 4.0


def budget_for(path) -> float:
    """Seconds ``path`` may take: ``TPU_NB_BUDGET`` if set, else the notebook's own budget times
    the machine factor (``TPU_NB_MACHINE_FACTOR``, 1 unless a run calibrated it)."""
    override = os.environ.get("TPU_NB_BUDGET")
    return float(override) if override else float(budget_seconds(path)) * factor_in_use()


def factor_in_use() -> float:
    """The machine factor this run applies: ``TPU_NB_MACHINE_FACTOR``, else 1."""
    return float(os.environ.get("TPU_NB_MACHINE_FACTOR") or 1)


def machine_factor() -> tuple[float, float]:
    """(factor, seconds): how much slower than :data:`REFERENCE_IMPORT_S` a fresh Python
    imports torch_xla now, at least 1 and at most :data:`MAX_FACTOR`. This host's memory is
    sometimes several times slower to fault in (a fresh ``import torch_xla`` took 24-44 s for an
    hour on 2026-11-29, notebook 14 alone 127-146 s against 47 s), and a notebook's time is
    mostly imports and compiles: the budget scales with the machine, not with the notebook."""
    from importlib.metadata import version

    line = ".".join(version("torch_xla").split(".")[:2])
    start = time.perf_counter()
    subprocess.run([sys.executable, "-I", "-c", "import torch_xla"], capture_output=True,
                   env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=600, check=True)
    seconds = time.perf_counter() - start
    reference = REFERENCE_IMPORT_S.get(line, REFERENCE_IMPORT_S["2.9"])
    return min(MAX_FACTOR, max(1.0, seconds / reference)), seconds


def pytest_configure(config) -> None:
    """With ``TPU_NB_CALIBRATE=1`` (``make test``'s notebook runs), the controller measures the
    machine factor once, before any worker starts; the workers inherit it."""
    if (os.environ.get("TPU_NB_CALIBRATE") and not os.environ.get("TPU_NB_BUDGET")
            and not os.environ.get("TPU_NB_MACHINE_FACTOR")
            and not hasattr(config, "workerinput")):
        factor, seconds = machine_factor()
        os.environ["TPU_NB_MACHINE_FACTOR"] = f"{factor:.2f}"
        config._tpu_nb_calibration = (factor, seconds)


def pytest_report_header(config) -> str | None:
    got = getattr(config, "_tpu_nb_calibration", None)
    if got:
        return (f"notebook budgets x{got[0]:.2f}: a fresh import of torch_xla took {got[1]:.1f} s "
                f"(scripts/notebook_budget.py: REFERENCE_IMPORT_S, at most x{MAX_FACTOR:g})")
    return None


def stderr_lines(nb) -> list[tuple[int, str]]:
    """(cell index, line) of every stderr line in an executed notebook."""
    return [(i, line) for i, cell in enumerate(nb.cells) for out in cell.get("outputs", [])
            if out.get("output_type") == "stream" and out.get("name") == "stderr"
            for line in out.get("text", "").splitlines()]


class _Capture:
    """Wraps nbmake's NotebookRun.execute to keep the executed notebook for the checks below."""

    def __init__(self):
        self.nb = None
        self._orig = pytest_items.NotebookRun.execute

    def __enter__(self):
        orig, capture = self._orig, self

        def execute(run):
            # ipykernel forwards the process's own fd 1/2 (C++ logs, child processes) into the
            # cells, as a learner sees them, except when PYTEST_CURRENT_TEST is in its
            # environment (ipykernel/iostream.py): start the kernel without it.
            saved = os.environ.pop("PYTEST_CURRENT_TEST", None)
            try:
                res = orig(run)
            finally:
                if saved is not None:
                    os.environ["PYTEST_CURRENT_TEST"] = saved
            capture.nb = res.nb
            return res
        pytest_items.NotebookRun.execute = execute
        return self

    def __exit__(self, *exc):
        pytest_items.NotebookRun.execute = self._orig


def check_stderr(path: Path, nb) -> None:
    lines = stderr_lines(nb)
    bad = [(i, ln) for i, ln in lines if unexplained([ln])]
    if bad:
        shown = "\n".join(f"  cell {i}: {ln[:160]}" for i, ln in bad[:12])
        pytest.fail(f"{path.name} shows {len(bad)} stderr line(s) no entry in "
                    f"scripts/stderr_allowlist.py explains:\n{shown}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if item.path.suffix != ".ipynb":
        return (yield)
    start = time.perf_counter()
    with _Capture() as cap:
        result = yield
    seconds = time.perf_counter() - start
    if cap.nb is not None:
        folder = os.environ.get("TPU_NB_EXECUTED")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            nbformat.write(cap.nb, str(Path(folder) / item.path.name))
        check_stderr(item.path, cap.nb)
    budget = budget_for(item.path)
    if seconds > budget:
        pytest.fail(f"{item.path.name} ran {seconds:.0f} s, over its {budget:.0f} s budget "
                    "(metadata.tpu_notebooks.budget_seconds, times the machine factor "
                    f"{factor_in_use():.2f}; "
                    "TPU_NB_BUDGET overrides)", pytrace=False)
    return result
