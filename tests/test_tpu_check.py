"""The TPU run record: scripts/tpu_check.py refuses to record without a TPU, records what
ran where, and the README shows the newest committed record (or that there is none)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import tpu_check  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CI": "true", "SMOKE": "1"}  # the script must drop both
    return subprocess.run([sys.executable, str(REPO / "scripts" / "tpu_check.py"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_shows_the_newest_committed_record():
    records = json.loads((REPO / "results" / "tpu_runs.json").read_text())
    readme = (REPO / "README.md").read_text()
    block = readme.split(tpu_check.START, 1)[1].split(tpu_check.END, 1)[0].strip()
    assert block == tpu_check.render(records)
    if not records:
        assert block == "No TPU run recorded yet."


def test_without_a_tpu_nothing_is_recorded(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    proc = _run("--results", str(tmp_path / "runs.json"), "--readme", str(readme))
    assert proc.returncode == 2 and "No TPU here" in proc.stderr
    assert not (tmp_path / "runs.json").exists()
    assert readme.read_text() == (REPO / "README.md").read_text()


@pytest.mark.slow
def test_a_run_is_recorded_with_what_ran_where(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    proc = _run("--allow-cpu", "--only", "00", "--results", str(tmp_path / "runs.json"),
                "--readme", str(readme))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (record,) = json.loads((tmp_path / "runs.json").read_text())
    env = record["environment"]
    assert env["platform"] == "local" and env["tpu_generation"] is None  # not a TPU run
    assert env["torch-xla"] and env["torch"]
    (row,) = record["notebooks"]
    assert row["notebook"] == "00_environment.ipynb" and row["status"] == "ok"
    assert row["seconds"] > 0
    text = readme.read_text()
    assert "| 00_environment.ipynb | ok |" in text and "No TPU run recorded yet." not in text
    assert text.split(tpu_check.START)[0] == (REPO / "README.md").read_text().split(
        tpu_check.START)[0]  # only the block changed
