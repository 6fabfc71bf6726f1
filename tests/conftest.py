"""Shared test setup: every test process uses the local XLA:CPU emulation, one device.

Tests that need another device count or SPMD run a fresh Python in a subprocess (the
device count is fixed at the first XLA use in a process); see ``run_python``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
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


def run_script(folder: Path, name: str, code: str, *args: str,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Write ``code`` to ``folder/name`` and run it there in a fresh Python that can import
    this repository (for scripts that fork or spawn processes, which ``python -c`` cannot
    re-import); fail with its output if it fails."""
    script = folder / name
    script.write_text(code)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(script), *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture
def repo() -> Path:
    return REPO


def gloo_ranks(worker: str, world: int, folder: Path, *args: str,
               timeout: float = 240) -> list[dict]:
    """Run ``worker`` (Python source) as ``world`` real processes, each given its rank, the
    world size, ``folder`` and ``args``; each writes ``folder/report-<rank>.json``. Fails
    naming the rank that failed; returns the reports in rank order."""
    import json

    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(worker), str(r), str(world),
                               str(folder), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{text[-3000:]}"
    return [json.loads((folder / f"report-{r}.json").read_text()) for r in range(world)]


def kill_mid_write(folder: Path, code: str, *, ready: str, min_bytes: int,
                   marker: str = ".tmp-") -> tuple[subprocess.Popen[str], list[Path]]:
    """Run ``code`` (argv[1] = ``folder``); once it prints ``ready`` and a temp file
    (``marker`` in its name) in ``folder`` has ``min_bytes``, SIGKILL it. Returns the
    process and the temp files seen at the kill (empty: the kill did not land mid-write)."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    temp: list[Path] = []
    try:
        assert proc.stdout.readline().strip() == ready, proc.stderr.read()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            temp = [p for p in folder.iterdir() if marker in p.name]
            if temp and temp[0].stat().st_size > min_bytes:
                break
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, temp


#: This package's own entries in a venv's site-packages (its editable install included).
OURS = ("tpu_helpers", "__editable__", "_tpu_helpers", "course", "tpu_notebooks_data")


def venv_without_us(root: Path, hide=lambda name: False) -> Path:
    """A new venv (no pip) in ``root`` that sees this venv's packages except this package's own
    and those ``hide(name)`` names; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    links = root / "links"
    links.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not (entry.name.startswith(OURS) or entry.suffix == ".pth" or hide(entry.name)):
            (links / entry.name).symlink_to(entry)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout
    (Path(site.strip()) / "this_venvs_packages.pth").write_text(f"{links}\n")
    return python


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``both_lines`` the tests whose code touches what the torch_xla line can change
    (``tests/lines.py``; not those marked ``one_line``): `make test` runs those on 2.8 too."""
    import lines

    for item in items:
        if (item.path.name.startswith("test_") and item.path.suffix == ".py"
                and item.path.parent == REPO / "tests" and not item.get_closest_marker("one_line")
                and getattr(item, "originalname", item.name) in lines.both_lines(item.path)):
            item.add_marker(pytest.mark.both_lines)
