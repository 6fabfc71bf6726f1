"""The template's time budget, enforced: nbmake runs each notebook as one test item, and a
notebook that takes longer than its budget fails, naming its time. The budget is the
notebook's own ``metadata.tpu_notebooks.budget_seconds`` (at most 90; 90 if it has none);
``TPU_NB_BUDGET=<seconds>`` overrides it for every notebook (e.g. on a loaded machine).

A pytest plugin loaded by ``-p scripts.notebook_budget`` (pyproject.toml's addopts), not a
conftest.py: a second conftest module would shadow ``tests/conftest.py`` for the tests'
``from conftest import ...``."""

from __future__ import annotations

import os
import time

import pytest

from scripts.notebook_template import budget_seconds


def budget_for(path) -> float:
    """Seconds ``path`` may take: ``TPU_NB_BUDGET`` if set, else the notebook's own budget."""
    override = os.environ.get("TPU_NB_BUDGET")
    return float(override) if override else float(budget_seconds(path))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    start = time.perf_counter()
    result = yield
    seconds = time.perf_counter() - start
    if item.path.suffix == ".ipynb":
        budget = budget_for(item.path)
        if seconds > budget:
            pytest.fail(f"{item.path.name} ran {seconds:.0f} s, over its {budget:.0f} s budget "
                        "(metadata.tpu_notebooks.budget_seconds; TPU_NB_BUDGET overrides)",
                        pytrace=False)
    return result
