"""The template's time budget, enforced: nbmake runs each notebook as one test item, and a
notebook that takes longer than its budget fails, naming its time. The budget is the
notebook's own ``metadata.tpu_notebooks.budget_seconds`` (at most 90; 90 if it has none);
``TPU_NB_BUDGET=<seconds>`` overrides it for every notebook (e.g. on a loaded machine).

It also fails a notebook whose executed output shows a learner a stderr line that
``scripts/stderr_allowlist.py`` does not explain (library banners, deprecation chatter,
interleaved rank output are noise), and with ``TPU_NB_EXECUTED=<folder>`` it writes each
executed copy there (``scripts/notebook_stats.py --executed`` reads them).

A pytest plugin loaded by ``-p scripts.notebook_budget`` (pyproject.toml's addopts), not a
conftest.py: a second conftest module would shadow ``tests/conftest.py`` for the tests'
``from conftest import ...``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbmake import pytest_items

from scripts.notebook_template import budget_seconds
from scripts.stderr_allowlist import unexplained


def budget_for(path) -> float:
    """Seconds ``path`` may take: ``TPU_NB_BUDGET`` if set, else the notebook's own budget."""
    override = os.environ.get("TPU_NB_BUDGET")
    return float(override) if override else float(budget_seconds(path))


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
                    "(metadata.tpu_notebooks.budget_seconds; TPU_NB_BUDGET overrides)",
                    pytrace=False)
    return result
