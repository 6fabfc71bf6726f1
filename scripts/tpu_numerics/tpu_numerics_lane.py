"""pytest plugin of the TPU-numerics lane (``make test-tpu-numerics``; ``-p tpu_numerics_lane``).

Each notebook runs in a Jupyter kernel that nbmake starts during the test; the plugin sets
``TPU_NUMERICS=1`` for that kernel only, so the kernel (and every replica it forks or spawns)
rounds and writes its proof files into ``$TPU_NUMERICS_DIR/<notebook>/``, while the test files
of the same run (the platform runs, ``make test-platforms``) keep exact float32. After the
notebook ran, the test fails unless some process of that notebook rounded at least one matmul: a
lane whose emulation silently did not load would otherwise pass on exact fp32 numbers. The
terminal summary lists the counts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from tpu_numerics import counts


def _base() -> Path:
    base = os.environ.get("TPU_NUMERICS_DIR")
    if not base:
        raise pytest.UsageError("the TPU-numerics lane needs TPU_NUMERICS_DIR (and "
                                "scripts/lanes and scripts/tpu_numerics on PYTHONPATH)")
    return Path(base)


def pytest_configure(config: pytest.Config) -> None:
    _base()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if item.path.suffix != ".ipynb":
        return (yield)
    base = _base()
    folder = base / item.path.stem
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    saved = os.environ.get("TPU_NUMERICS")
    os.environ.update(TPU_NUMERICS="1", TPU_NUMERICS_DIR=str(folder))  # the kernel inherits them
    try:
        result = yield
    finally:
        os.environ["TPU_NUMERICS_DIR"] = str(base)
        if saved is None:
            os.environ.pop("TPU_NUMERICS")
        else:
            os.environ["TPU_NUMERICS"] = saved
    found = counts(str(folder))
    if not any(found.values()):
        pytest.fail(f"{item.path.name}: the TPU-numerics emulation rounded no matmul in any "
                    f"process (no proof file in {folder}); were scripts/lanes and "
                    "scripts/tpu_numerics on the kernel's PYTHONPATH?", pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter) -> None:
    base = Path(os.environ.get("TPU_NUMERICS_DIR", ""))
    if not base.is_dir():
        return
    terminalreporter.section("TPU-numerics lane: rounded matmul calls per notebook")
    for folder in sorted(p for p in base.iterdir() if p.is_dir()):
        found = counts(str(folder))
        terminalreporter.write_line(f"{folder.name}: {sum(found.values())} rounded calls in "
                                    f"{len(found)} process(es)")
