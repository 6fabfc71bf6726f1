"""Notebook 02's plumbing (course only): catching what a loader's background thread raises,
the per-step table of the three timed loops, and their picture. The loops themselves are
``course/loader_experiments.py``; the lessons stay in ``notebooks/02_parallel_loader.ipynb``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import pandas as pd

#: The three loops of ``loader_experiments.compare_loops``, in the order the notebook shows.
LOOPS = ["naive .to(device)", "MpDeviceLoader", "on device (ceiling)"]


def iterate_catching_thread_errors(loader: Iterable, wait_s: float = 5.0) -> tuple[int, list]:
    """Iterate ``loader`` to its end; return the items it yielded and the exceptions raised in
    background threads meanwhile (``threading.excepthook`` arguments). A thread reports its
    error as it exits, so this waits up to ``wait_s`` for a first one."""
    errors: list[Any] = []
    default_hook, threading.excepthook = threading.excepthook, errors.append
    try:
        items = sum(1 for _ in loader)
        deadline = time.monotonic() + wait_s
        while not errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        threading.excepthook = default_hook
    return items, errors


def per_step_counts(results: pd.DataFrame) -> pd.DataFrame:
    """Per training step, from ``compare_loops`` rows indexed by (pipeline, name): transfers,
    the input copies among them (the ceiling's own transfers subtracted), batches per input
    copy, executions, compiles and host milliseconds outside the step."""
    seed = results.xs(LOOPS[2], level="name").transfers_per_step  # the step's own transfer
    inputs = results.transfers_per_step.sub(seed, level="pipeline")
    return pd.DataFrame({
        "transfers": results.transfers_per_step, "of them: input copies": inputs,
        "batches per input copy": (1 / inputs).where(inputs > 0),
        "executions": results.executions_per_step, "compiles": results.compiles / results.steps,
        "host ms outside the step": results.ms_outside_step_per_step,
    }).rename_axis(columns="per training step")


def plot_loops(results: pd.DataFrame, per_step: pd.DataFrame, where: str) -> pd.DataFrame:
    """Transfers per step (exact, in-memory pipeline) beside steps/s (best round) of each
    loop and pipeline; returns the steps/s table (pipelines x loops)."""
    import matplotlib.pyplot as plt

    rates = results.steps_per_s.unstack("name")[LOOPS]
    speedup = rates[LOOPS[1]] / rates[LOOPS[0]]
    transfers = per_step.transfers
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.8), width_ratios=[1, 2],
                                      layout="constrained")
    exact = transfers.xs("in-memory (ArrayDataset)", level="pipeline")[LOOPS]
    exact.plot.barh(ax=left, color=["C3", "C0", "C7"]).invert_yaxis()
    left.set(xlabel="host-to-device transfers per step (exact)", ylabel="")
    rates.plot.barh(ax=right, color=["C3", "C0", "C7"]).invert_yaxis()
    right.set(xlabel="training steps/s (batch 64; best round)", ylabel="")
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=8)
    naive = transfers.xs(LOOPS[0], level="name").max()
    mp = transfers.xs(LOOPS[1], level="name").max()
    fig.suptitle(f"MpDeviceLoader: {naive:.0f} -> {mp:.1f} transfers per step; on {where} "
                 f"it ran {speedup.min():.2f}-{speedup.max():.2f}x as fast as the naive loop")
    plt.show()
    return rates
