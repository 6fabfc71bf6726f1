"""The template's time budget, enforced: nbmake runs each notebook as one test item, and a
notebook that takes longer than 90 s (``TPU_NB_BUDGET`` seconds) fails, naming its time.

A pytest plugin loaded by ``-p scripts.notebook_budget`` (pyproject.toml's addopts), not a
conftest.py: a second conftest module would shadow ``tests/conftest.py`` for the tests'
``from conftest import ...``."""

from __future__ import annotations

import os
import time

import pytest

BUDGET_S = float(os.environ.get("TPU_NB_BUDGET", "90"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    start = time.perf_counter()
    result = yield
    seconds = time.perf_counter() - start
    if item.path.suffix == ".ipynb" and seconds > BUDGET_S:
        pytest.fail(f"{item.path.name} ran {seconds:.0f} s, over the template's "
                    f"{BUDGET_S:.0f} s budget per notebook (TPU_NB_BUDGET)", pytrace=False)
    return result
