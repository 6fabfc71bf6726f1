"""The text benchmark (benchmarks/bench_text.py) at tiny settings: the rows' structure and
the compile counts, which are exact (speed is not checked: XLA:CPU on a shared machine)."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

if str(REPO) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not add the cwd
    sys.path.insert(0, str(REPO))

from benchmarks import bench_text, run_all  # noqa: E402

TINY = {"layers": 1, "steps": 2, "rounds": 1, "a_rounds": 1, "precision_steps": 1,
        "depths": (1,)}


@pytest.fixture(scope="module")
def padding_rows():
    from tpu_helpers.env import configure_emulation

    configure_emulation(num_devices=1)
    return bench_text.measure_padding(TINY)


def test_buckets_compile_once_per_bucket_and_never_after_warmup(padding_rows):
    rows = {r["key"]: r for r in padding_rows}
    assert list(rows) == ["a", "b", "c"]
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert (b["compiles_warmup"], b["compiles_after_warmup"]) == (1, 0)  # one shape: 16 x 256
    assert (c["compiles_warmup"], c["compiles_after_warmup"]) == (len(bench_text.BOUNDS), 0)
    # (a): one compile per shape no strategy had compiled before, during warm-up and after
    assert a["compiles_warmup"] == a["new_shapes_warmup"] == 1
    assert a["compiles_after_warmup"] == a["new_shapes_after"]
    assert b["ratio_vs_pad_to_max"] == 1.0 and c["ratio_vs_pad_to_max"] > 0
    assert 0 < c["padding_share"] < b["padding_share"] < 1
    assert c["steps_timed"] == a["steps_timed"] == TINY["steps"]
    met = dict(run_all.text_goals(padding_rows))
    assert met["text: buckets compile 3 times == 3 buckets"]
    assert met["text: buckets 0 compiles after warm-up"]
    assert [t["benchmark"] for t in run_all.table_rows(padding_rows)] == ["text padding"] * 3


def test_scan_rows_compile_one_graph_per_call():
    from tpu_helpers.env import configure_emulation

    configure_emulation(num_devices=1)
    rows = bench_text.measure_scan(TINY)
    assert [(r["layers"], r["scan"], r["compiles"]) for r in rows] == [(1, False, 1),
                                                                       (1, True, 1)]
    assert rows[0]["ratio_vs_loop"] == 1.0 and all(r["first_call_s"] > 0 for r in rows)
    assert run_all.table_rows(rows)[1]["row"] == "1 blocks, scan_layers"


def test_state_bytes_per_parameter_counts_weights_grads_and_adamw_state():
    import torch

    for dtype, expected in ((torch.float32, 16.0), (torch.bfloat16, 8.0)):
        model = torch.nn.Linear(4, 3).to(dtype)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4, dtype=dtype)).sum().backward()
        opt.step()  # creates exp_avg and exp_avg_sq, each the size and dtype of the weight
        assert bench_text.state_bytes_per_parameter(model, opt) == expected


@pytest.mark.slow
def test_precision_rows_autocast_keeps_float32_master_weights():
    from tpu_helpers.env import configure_emulation

    configure_emulation(num_devices=1)
    rows = {r["name"]: r for r in bench_text.measure_precision(TINY)}
    assert rows["float32"]["bytes_per_param"] == 16.0
    assert rows["autocast bf16"]["bytes_per_param"] == 16.0  # fp32 weights, grads, AdamW state
    assert rows["pure bf16 weights"]["bytes_per_param"] == 8.0
    assert all(r["compiles"] == 1 for r in rows.values())
