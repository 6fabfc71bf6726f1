"""The training benchmark's measurements (tpu_helpers.metrics inside benchmarks/) and its table.

The row functions run for real on XLA:CPU in this process; the summary and goal logic is
checked on fixed numbers.
"""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

if str(REPO) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not add the cwd
    sys.path.insert(0, str(REPO))

from benchmarks import bench_training, run_all  # noqa: E402


def _row(key: str, rate: float, compiles_after: int = 0) -> dict:
    warm = [{"steps": 10, "seconds": 10 / r, "cpu_seconds": 0.1, "host_seconds": 0.02,
             "n_compiles": 0,
             "n_executions": 10, "n_transfers_to_device": 10, "n_transfers_from_device": 1,
             "n_fallback_ops": 0} for r in (rate * 0.9, rate, rate * 1.1)]
    return {"key": key, "epochs": 2, "cold_compiles": 2 + compiles_after, "compiles_warmup": 2,
            "compiles_after_warmup": compiles_after, "cold_steps": 10, "warm": warm,
            "peak_rss_mb": 900.0, "log_lines": 0}


def test_summarise_medians_ratios_and_goals():
    results = {"a": [_row("a", 20.0, 1)], "b": [_row("b", 30.0, 1)], "c": [_row("c", 10.0, 3)],
               "d": [_row("d", 40.0)], "e": [_row("e", 45.0)],
               "d_sgd": [_row("d_sgd", 50.0)], "e_sgd": [_row("e_sgd", 55.0)]}
    rows = bench_training.summarise(results)
    by_key = {r["key"]: r for r in rows}
    assert by_key["d"]["steps_per_s"] == 40.0 and by_key["d"]["ratio_vs_ours"] == 1.0
    assert by_key["a"]["ratio_vs_ours"] == 0.5
    assert by_key["d"]["ratio_vs_ceiling"] == round(40 / 45, 3)
    assert by_key["c"]["steps_per_s_min"] == 9.0 and by_key["c"]["steps_per_s_max"] == 11.0
    assert by_key["b"]["d2h_per_step"] == 0.1 and by_key["b"]["runs"] == 3
    assert by_key["b"]["host_ms_per_step"] == 2.0 and by_key["b"]["cpu_ms_per_step"] == 10.0
    met = dict(run_all.goals(rows))
    assert met["(d) ours: 0 compiles after warm-up"]
    assert met["(d) ours: fewest compiles after warm-up of all rows"]
    assert met["(d') ours with SGD steps/s >= (b) upstream pattern (SGD)"]  # 50 vs 30
    assert not met["(d) ours / (e) ceiling = 0.89 >= 0.95"]
    assert met["(d') ours host ms/step 2.00 <= (b) upstream's 2.00"]
    table = run_all.table_rows(rows)
    assert [t["row"] for t in table] == [bench_training.ROWS[k] for k in results]
    assert table[2]["compiles"] == "2 + 3 after"


def test_summarise_reports_a_missed_goal():
    results = {"b": [_row("b", 30.0)], "d": [_row("d", 20.0, compiles_after=1)],
               "e": [_row("e", 40.0)]}
    met = dict(run_all.goals(bench_training.summarise(results)))
    assert not met["(d) ours: 0 compiles after warm-up"]
    assert not met["(d) ours steps/s >= (b) upstream pattern (SGD)"]
    assert not met["(d) ours / (e) ceiling = 0.50 >= 0.95"]


@pytest.mark.slow
def test_ours_row_compiles_nothing_after_warmup_and_reads_only_to_log():
    result = bench_training.measure_row("d", epochs=2, repeats=1)
    assert result["compiles_after_warmup"] == 0  # a recompile in tpu_helpers.train fails here
    [warm] = result["warm"]
    assert warm["steps"] == 2 * (1437 // 64) and warm["n_compiles"] == 0
    assert warm["n_executions"] == warm["steps"]  # one graph per step: no host cut
    # per epoch: one log read (step 20 of 22) and the epoch summary
    assert warm["n_transfers_from_device"] == 2 * 2


@pytest.mark.slow
def test_article_loop_trains_one_epoch_and_cuts_graphs():
    result = bench_training.measure_row("a", epochs=2, repeats=1)
    [warm] = result["warm"]
    assert warm["steps"] == -(-1437 // 64)  # 23: the exhausted ParallelLoader, epoch 2 empty
    assert warm["n_transfers_from_device"] == 3  # loss.item() at batches 0, 10, 20
    assert warm["n_executions"] == warm["steps"] + 3  # each .item() cuts the step's graph
    assert result["compiles_after_warmup"] >= 1  # the ragged last batch (1437 % 64 = 29)


def test_host_time_counts_tracing_not_the_devices_execution():
    """The benchmark's host ms/step: this thread and the autograd threads, not XLA's execution.

    The same 40 traced ops with 64x64 and with 1024x1024 matrices (about 1,000 times the device
    work): the process's CPU time grows by the execution, the host time does not."""
    import time

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()

    def run(size: int) -> tuple[float, float]:
        a = torch.randn(size, size, device=device, requires_grad=True)
        xm.wait_device_ops()
        host, cpu = bench_training.host_cpu_seconds(), time.process_time()
        for _ in range(4):
            x = a
            for _ in range(5):
                x = torch.tanh(x @ a)
            x.sum().backward()  # traced on PyTorch's autograd thread: counted
            torch_xla.sync()
            xm.wait_device_ops()
        return bench_training.host_cpu_seconds() - host, time.process_time() - cpu

    run(64), run(1024)  # compile both
    small, big = run(64), run(1024)
    print(f"host s, process CPU s: 64x64 {small}, 1024x1024 {big}")
    execution = big[1] - small[1]  # the device's execution: CPU seconds on other threads
    assert execution > 0.2
    # Were the execution counted (host time = the process's CPU time), the host time would grow
    # by the execution itself. It grows by what the host does per byte (allocating the bigger
    # outputs): 4% of it here (77 ms of 1.8 s), 5-8% in two runs where this machine's memory was
    # slow (166 ms of 3.4 s, 198 ms of 2.5 s). The bound, a quarter, is 4x below the former.
    assert big[0] < 0.25 * big[1] and big[0] - small[0] < 0.25 * execution


def test_the_watchdog_ticks_cost_under_one_percent_of_ours_host_time():
    """Issue 38's goal, measured: one tick into an open slot (a real hang_watchdog slot, in a
    process of its own), twice per step, against ours' host ms/step; the goal reads the row."""
    tick_us = bench_training.watchdog_tick_us(n=20_000, rounds=3)
    print(f"one tick: {tick_us:.2f} us")
    assert 0 < tick_us < 20  # about half a microsecond here
    rows = bench_training.summarise({"d": [_row("d", 40.0)]})  # host 2.0 ms/step
    rows[0].update(watchdog_us_per_step=round(2 * tick_us, 2),
                   watchdog_share_of_host=2 * tick_us / 1e3 / rows[0]["host_ms_per_step"])
    [(text, met)] = [g for g in run_all.goals(rows) if "watchdog" in g[0]]
    print(text)
    assert met and text.endswith("< 1% of its host ms/step")
