"""tpu_helpers.metrics (the guard) and course.compile_analysis (the course's tables and
compile causes) on real torch_xla (XLA:CPU): counts, limits, explanations, DataFrames.

The central promise: a block that introduces a recompile (a new input shape, a Python
branch on a tensor value, a ragged last batch) fails under ``track(max_compiles=0)``.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch
import torch_xla
from conftest import run_python
from torch import nn

from course.compile_analysis import (
    CompileCause,
    measure_steps,
    metrics_delta,
    metrics_frame,
    parse_compile_analysis,
    track_with_analysis,
)
from course.models import DigitsCNN
from tpu_helpers.metrics import Counts, LimitExceeded, snapshot, track


def _lineno(marker: str) -> int:
    """Line number in this file of the line containing ``marker``."""
    lines = inspect.getsource(inspect.getmodule(_lineno)).splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line and "_lineno" not in line)


@pytest.fixture(scope="module")
def device():
    return torch_xla.device()


@pytest.fixture
def train_step(device):
    """A DigitsCNN SGD step, written plainly: forward, backward, step, sync."""
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        torch_xla.sync()
        return loss

    return step


def _batch(device, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x.to(device), y.to(device)


def test_counts_subtract_and_snapshot_is_monotonic(device):
    a = snapshot()
    (torch.ones(3, device=device) * 2).sum().item()
    b = snapshot()
    d = b - a
    assert isinstance(d, Counts)
    assert d.executions >= 1 and d.transfers_from_device >= 1
    assert set(d.as_dict()) == {"compiles", "executions", "transfers_to_device",
                                "transfers_from_device", "fallback_ops"}


def test_steady_training_step_compiles_nothing_after_warmup(device, train_step):
    batches = [_batch(device, 32, seed) for seed in range(4)]
    train_step(*batches[0])  # warm-up: compiles the step once
    with track(max_compiles=0, max_transfers_from_device=0, what="steady steps") as t:
        for x, y in batches[1:]:
            train_step(x, y)
    assert t.counts.compiles == 0
    assert t.counts.executions == 3  # one graph per step
    assert t.counts.transfers_from_device == 0
    assert t.host_syncs == []


def test_a_new_batch_shape_is_a_recompile_and_fails(device, train_step):
    x, y = _batch(device, 32)
    train_step(x, y)
    train_step(x, y)
    ragged_x, ragged_y = _batch(device, 20)  # the ragged last batch of an epoch
    with pytest.raises(LimitExceeded) as info:
        with track(max_compiles=0, what="last batch"):
            train_step(ragged_x, ragged_y)
    message = str(info.value)
    assert message.startswith("last batch: 1 compiles (limit 0)")
    assert "PT_XLA_DEBUG_LEVEL=1" in message  # says how to get the cause


def test_python_branch_on_a_tensor_is_caught_with_its_line(device, train_step):
    x, y = _batch(device, 32)
    train_step(x, y)

    def step_with_branch(x, y):
        loss = train_step(x, y)
        if loss > 100:  # BRANCH-LINE: reads the loss on the host
            print("diverged")

    step_with_branch(x, y)
    with pytest.raises(LimitExceeded) as info:
        with track(max_transfers_from_device=0, what="step with branch") as t:
            step_with_branch(x, y)
    assert t.counts.transfers_from_device == 1
    assert [h.op for h in t.host_syncs] == ["bool()"]
    where = f"test_metrics.py:{_lineno('BRANCH-LINE')}"
    assert where in t.host_syncs[0].where
    assert where in str(info.value) and "1 device-to-host transfers (limit 0)" in str(info.value)


def test_item_and_print_are_host_reads_with_their_lines(device, capsys):
    v = torch.arange(4.0, device=device) * 3
    with track(record_host_syncs=True) as t:
        s = v.sum().item()  # ITEM-LINE
        print(v)  # PRINT-LINE
    assert s == 18.0
    assert "tensor([0., 3., 6., 9.], device='xla:0')" in capsys.readouterr().out
    ops = [(h.op, h.where.rsplit(":", 1)[1].rstrip(")")) for h in t.host_syncs]
    assert ops == [("item()", str(_lineno("ITEM-LINE"))), ("print/str", str(_lineno("PRINT-LINE")))]
    assert t.counts.transfers_from_device >= 2


def test_cpu_fallback_op_is_counted_and_named(device):
    t_ = torch.arange(10.0, device=device)
    torch_xla.sync()
    with pytest.raises(LimitExceeded) as info:
        with track(max_fallback_ops=0, what="masked select") as t:
            kept = t_[t_ > 4.0]  # masked indexing needs aten::nonzero: no XLA lowering
            torch_xla.sync()
    assert kept.shape == (5,)
    assert t.fallback_ops == {"aten::nonzero": 1}
    assert t.counts.fallback_ops == 1
    assert "aten::nonzero x1" in str(info.value)


def test_limits_that_hold_do_not_raise_and_none_means_unchecked(device):
    v = torch.ones(5, device=device)
    with track(max_compiles=5, max_executions=5, max_transfers_from_device=5) as t:
        (v + 1).sum().item()
    assert 1 <= t.counts.executions <= 5
    with track() as t2:  # no limits: only counts
        (v + 2).sum().item()
    assert t2.counts.transfers_from_device >= 1


def test_exception_in_block_propagates_unchanged(device):
    with pytest.raises(KeyError, match="boom"):
        with track(max_compiles=0):
            raise KeyError("boom")


def test_metrics_frame_and_delta(device):
    before = metrics_frame()
    assert list(before.columns) == ["kind", "count", "total", "unit"]
    w = torch.full((7, 7), 0.5, device=device)
    (w @ w + 13.0).sum().item()  # a graph never built before in this process
    after = metrics_frame()
    delta = metrics_delta(before, after)
    assert delta.loc["CompileTime", "count"] == 1
    assert delta.loc["CompileTime", "unit"] == "s" and delta.loc["CompileTime", "total"] > 0
    assert delta.loc["ExecuteTime", "count"] >= 1
    assert delta.loc["TransferFromDeviceTime", "count"] == 1
    assert (delta["count"] != 0).all()  # changed_only drops the rest
    everything = metrics_delta(before, after, changed_only=False)
    assert len(everything) == len(after.index.union(before.index))
    assert after.loc["InboundData", "unit"] == "bytes"


def test_report_in_track_is_the_blocks_delta(device):
    v = torch.full((3,), 4.0, device=device)
    with track_with_analysis(report=True) as t:
        (v * 11.0).sum().item()
    report = t.details["report"]
    assert report.loc["ExecuteTime", "count"] == t.counts.executions
    assert report.loc["TransferFromDeviceTime", "count"] == t.counts.transfers_from_device


SAMPLE = textwrap.dedent("""\
    Compilation Analysis: ==========
    Compilation Analysis: Compilation Cause
    Compilation Analysis:   most likely user code trying to access tensor value before torch_xla.sync
    Compilation Analysis: Graph Info: 
    Compilation Analysis:   Graph Hash: 9588193ba29ad5db5bdc42657a77da89
    Compilation Analysis:   Number of Graph Inputs: 1
    Compilation Analysis:   Number of Graph Outputs: 1
    Compilation Analysis: Python Frame Triggered Execution: 
    Compilation Analysis:   sync (/x/site-packages/torch_xla/torch_xla.py:87)
    Compilation Analysis:   train (/home/me/train.py:10)
    Compilation Analysis: ----------
    Compilation Analysis: ==========
    unrelated line
    Execution Analysis: ==========
    Execution Analysis: Execution Cause
    Execution Analysis:   user torch_xla.sync
    Execution Analysis: Graph Info: 
    Execution Analysis:   Graph Hash: fed1354c
    Execution Analysis: Python Frame Triggered Execution: 
    Execution Analysis:   <module> (/home/me/train.py:3)
    Execution Analysis: ----------
    """)  # noqa: W291, E501


def test_parse_compile_analysis_text():
    [c] = parse_compile_analysis(SAMPLE)
    assert c == CompileCause(
        cause="most likely user code trying to access tensor value before torch_xla.sync",
        graph_hash="9588193ba29ad5db5bdc42657a77da89",
        frames=("sync (/x/site-packages/torch_xla/torch_xla.py:87)",
                "train (/home/me/train.py:10)"),
    )
    [e] = parse_compile_analysis(SAMPLE, kind="Execution")
    assert e.cause == "user torch_xla.sync" and e.user_frame == "<module> (/home/me/train.py:3)"
    assert parse_compile_analysis("nothing here") == []


def test_debug_level_2_stderr_of_a_real_process_is_parsed():
    code = """
        import torch, torch_xla
        dev = torch_xla.device()
        w = torch.ones(4, 4).to(dev)  # data on the device: no graph
        for n in (3, 3, 5):
            x = torch.ones(n, 4).to(dev)
            y = (x @ w).sum()
            torch_xla.sync()  # SYNC
        print(y.item())
    """
    proc = run_python(code, env={"PT_XLA_DEBUG_LEVEL": "2"})
    assert proc.stdout.strip() == "80.0"  # 5 rows x 4 columns x 4
    compiles = parse_compile_analysis(proc.stderr)
    executions = parse_compile_analysis(proc.stderr, kind="Execution")
    # shapes 3, 3, 5: two graphs compiled, three executed
    assert len(compiles) == 2 and len(executions) == 3
    assert len({c.graph_hash for c in compiles}) == 2
    assert all(c.cause == "user torch_xla.sync" for c in compiles)
    assert all(c.user_frame == "<module> (<string>:8)" for c in compiles)
    assert executions[0].graph_hash == executions[1].graph_hash == compiles[0].graph_hash


def test_enable_compile_analysis_names_cause_and_frame_in_the_error(tmp_path):
    code = f"""
        from course.compile_analysis import enable_compile_analysis, track_with_analysis
        from tpu_helpers.metrics import LimitExceeded
        path = enable_compile_analysis({str(tmp_path / 'analysis.txt')!r})
        import torch, torch_xla
        dev = torch_xla.device()
        w = torch.ones(4, 4, device=dev)
        def step(n):
            y = (torch.ones(n, 4, device=dev) @ w).sum()
            torch_xla.sync()  # line 10
            return y
        step(8); step(8)
        try:
            with track_with_analysis(max_compiles=0, what="new shapes") as t:
                step(5); step(6)
        except LimitExceeded as exc:
            print(exc)
            print("causes:", len(t.details["compile_causes"]))
        try:
            enable_compile_analysis("/tmp/elsewhere.txt")
        except RuntimeError as exc:
            print("TOO LATE:", exc)
    """
    out = run_python(code).stdout
    assert "new shapes: 2 compiles (limit 0)" in out
    assert out.count("(user torch_xla.sync) at step (<string>:10)") == 2
    assert "2 different graphs compiled at step (<string>:10)" in out
    assert "causes: 2" in out
    assert "TOO LATE: enable_compile_analysis() must run before the first XLA compile" in out
    # ones(4, 4) on the device, step(8), step(5), step(6): four compiles in the file
    assert (tmp_path / "analysis.txt").read_text().count("Compilation Cause") == 4


def test_measure_steps_counts_after_warmup(device, train_step):
    batches = [_batch(device, 16, seed) for seed in range(5)]
    steady = measure_steps(train_step, batches)
    assert steady.steps == 3 and steady.counts.compiles == 0
    assert steady.row()["executions/step"] == 1.0 and steady.row()["device-to-host/step"] == 0
    ragged = measure_steps(train_step, [*batches, _batch(device, 9)])
    assert ragged.counts.compiles == 1  # the short last batch: a new graph after warm-up
    with pytest.raises(ValueError, match="more than 2 batches"):
        measure_steps(train_step, batches[:2])


def test_on_exit_hook_adds_lines_to_the_error(device):
    def note(t):
        t.notes.append(f"hook saw {t.counts.compiles} compiles")
        t.details["seen"] = True

    w = torch.full((5, 3), 0.25, device=device)
    with pytest.raises(LimitExceeded) as info:
        with track(max_compiles=0, what="hooked", on_exit=note) as t:
            (w * 17.0).sum().item()  # a graph never built before in this process
    assert "hook saw 1 compiles" in str(info.value) and t.details == {"seen": True}


def test_spmd_executions_are_counted_in_execute_replicated_time():
    code = """
        import numpy as np, torch, torch_xla
        import torch_xla.debug.metrics as met
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        from tpu_helpers.metrics import track
        xr.use_spmd()
        mesh = xs.Mesh(np.arange(4), (4, 1))
        x = torch.ones(8, 4).to(torch_xla.device())
        xs.mark_sharding(x, mesh, (0, 1))
        with track() as t:
            (x * 2).sum().item()
        print(t.counts.executions, met.metric_data("ExecuteTime"))
    """
    out = run_python(code, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}).stdout
    assert out.split() == ["1", "None"]  # SPMD: ExecuteReplicatedTime, never ExecuteTime
