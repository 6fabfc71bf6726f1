"""This repository's package as a wheel (what the setup cell installs offline, via TPU_NB_SOURCE):
built from pyproject.toml without a warning, installed into a folder outside the repository,
and used from there with the repository out of sight: toolkit, course code and data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

pytestmark = pytest.mark.one_line  # packaging: the wheel carries no torch or torch_xla

USE = """
import json, pathlib, sys
import tpu_helpers, tpu_helpers.checkpoint, tpu_helpers.predict, tpu_helpers.train
import course.setup
from course.datasets import data_dir, load_digits, load_tabular_csv
from course.text import load_speeches
x, y = load_digits("train")
speeches = load_speeches(256)
features, labels = load_tabular_csv(data_dir() / "breast_cancer.csv")
print(json.dumps({"module": tpu_helpers.__file__, "course": course.setup.__file__,
                  "data": str(data_dir()),
                  "digits": list(x.shape), "table": list(features.shape),
                  "speeches": len(speeches)}))
"""


@pytest.mark.slow
def test_wheel_installs_alone_and_carries_the_data(tmp_path):
    dist, site, elsewhere = tmp_path / "dist", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist),
                            str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    # what a setup cell installing from a git URL or folder prints: nothing (setuptools warnings
    # are a page each: a license table, data folders not listed as packages)
    assert "Warning" not in build.stdout + build.stderr, build.stderr[-3000:]
    (wheel,) = dist.glob("tpu_helpers-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "tpu_helpers/train.py" in names and "tpu_notebooks_data/digits/labels.csv" in names
    assert "tpu_notebooks_data/tinyshakespeare/input.txt" in names  # notebook 09's text
    assert "course/setup.py" in names and "course/datasets.py" in names
    assert sum(n.startswith("tpu_notebooks_data/digits/images/") for n in names) == 1797
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "benchmarks/"))]
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(site), "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    env.pop("TPU_NB_DATA", None)
    proc = subprocess.run([sys.executable, "-c", USE], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["module"].startswith(str(site))  # the wheel's copy, not the repository's
    assert report["course"].startswith(str(site))
    assert report["data"].startswith(str(site))
    assert report["digits"] == [1437, 1, 8, 8] and report["table"] == [569, 30]
    assert report["speeches"] > 1000  # Tiny Shakespeare, one sample per speech
    # the training script runs from the wheel too
    run = subprocess.run([sys.executable, "-m", "tpu_helpers.train", "--max-steps", "2",
                          "--out-dir", str(tmp_path / "run")],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "history.json").read_text())["total_steps"] == 2
