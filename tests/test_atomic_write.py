"""One meaning of "atomic" for every file the package writes: a SIGKILL in the middle of
writing leaves the previous file whole (checkpoints: tests/test_checkpoint.py)."""

from __future__ import annotations

import json
import os
import signal

import pandas as pd
import pytest
from conftest import kill_mid_write

from tpu_helpers.checkpoint import TEMP_MARKER, atomic_write

WRITERS = {
    # each writes version 1 (small), says so, then version 2 (large, slow to write)
    "predictions csv": """
import sys, numpy as np, pandas as pd
from tpu_helpers.checkpoint import atomic_write
path = sys.argv[1] + "/predictions.csv"
def frame(values):  # what notebook 04's master writes: one row per dataset index
    return pd.DataFrame(values, index=pd.RangeIndex(len(values), name="index"))
atomic_write(path, frame(np.ones((3, 2), np.float32)).to_csv)
print("v1", flush=True)
atomic_write(path, frame(np.random.default_rng(0).random((3_000_000, 2), np.float32)).to_csv)
""",
    "history.json": """
import sys
from tpu_helpers.train import save_history
path = sys.argv[1] + "/history.json"
save_history(path, {"version": 1, "log": []})
print("v1", flush=True)
save_history(path, {"version": 2, "log": [{"step": i, "loss": 0.5} for i in range(400_000)]})
""",
}


def _kill_mid_write(tmp_path, code: str) -> str:
    proc, temp = kill_mid_write(tmp_path, code, ready="v1", min_bytes=100_000,
                                marker=TEMP_MARKER)  # version 2 is being written
    assert proc.returncode == -signal.SIGKILL
    assert temp, "the kill did not land mid-write"
    return temp[0].name


@pytest.mark.parametrize("what", sorted(WRITERS))
def test_sigkill_mid_write_leaves_the_previous_file_whole(tmp_path, what):
    temp = _kill_mid_write(tmp_path, WRITERS[what])
    if what == "history.json":
        assert temp.startswith("history.json" + TEMP_MARKER)
        assert json.loads((tmp_path / "history.json").read_text()) == {"version": 1, "log": []}
    else:
        assert temp.startswith("predictions.csv" + TEMP_MARKER)
        frame = pd.read_csv(tmp_path / "predictions.csv", index_col="index")
        assert frame.shape == (3, 2) and (frame.to_numpy() == 1).all()


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp_file(tmp_path):
    path = atomic_write(tmp_path / "a.txt", lambda f: f.write(b"old"))

    def half_then_fail(f):
        f.write(b"new, half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # not mkstemp's 0600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
