"""Shared test setup: every test process uses the local XLA:CPU emulation, one device.

Tests that need another device count or SPMD run a fresh Python in a subprocess (the
device count is fixed at the first XLA use in a process); see ``run_python``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # repository tooling (notebook_template, tpu_check)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python (repo root as cwd) and return the finished process."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def repo() -> Path:
    return REPO
