"""The Hugging Face benchmark (benchmarks/bench_hf.py) at tiny settings, each row in its own
process as `make bench` runs it: the compile and transfer counts are exact (speed is not
checked: XLA:CPU on a shared machine)."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

pytest.importorskip("transformers")
if str(REPO) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not add the cwd
    sys.path.insert(0, str(REPO))

from benchmarks import bench_hf, run_all  # noqa: E402

# The same Trainer's counts are pinned on both torch_xla lines by notebook 11 and
# tests/test_hugging_face.py; this checks the benchmark itself, on one line.
pytestmark = pytest.mark.one_line

# 3 steps: 2 of warm-up (the Trainer compiles a new program in its second step too) and one
# timed, in which (a) still meets new lengths (2 compiles) and (b) reads only the final loss
TINY = {"speeches": 24, "epochs": 1, "warmup": 2, "layers": 1}


@pytest.fixture(scope="module")
def rows():
    original = bench_hf.settings
    bench_hf.settings = lambda quick: TINY
    try:
        return {r["key"]: r for r in bench_hf.run(quick=True)}
    finally:
        bench_hf.settings = original


def test_trainer_defaults_recompile_and_notebook_11_settings_do_not(rows):
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert [r["steps"] for r in (a, b, c)] == [3, 3, 3]  # 24 speeches / 8: no short batch
    assert a["compiles_after_warmup"] > 0  # each new longest length is a new program
    assert b["compiles_after_warmup"] == 0 and c["compiles_after_warmup"] == 0
    # sdpa reads the mask at every step; eager reads only the final loss (the Trainer's), or nothing
    assert a["transfers_per_step"] >= 1
    assert b["transfers_per_step"] * (b["steps"] - TINY["warmup"]) == 1
    assert c["transfers_per_step"] == 0
    assert c["ratio_vs_course_loop"] == 1.0 and all(r["ms_per_step"] > 0 for r in (a, b, c))


def test_run_all_prints_the_rows_and_checks_the_compile_goals(rows):
    table = run_all.table_rows(list(rows.values()))
    assert [t["benchmark"] for t in table] == ["hugging face"] * 3
    goals = dict(run_all.hf_goals(list(rows.values())))
    assert goals["hf: Trainer with notebook 11's settings: 0 compiles after warm-up"]
    assert any(text.startswith("hf: Trainer defaults compile") and met
               for text, met in goals.items())
