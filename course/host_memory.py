"""Host RAM per process: why a dataset is built once, before fork, in numpy (or mmap).

Taught in ``notebooks/01_dataset_setup.ipynb``. On a TPU host ``torch_xla.launch`` runs
one process per chip (8 on a v5e-8); a dataset that every process builds for itself costs
8x the RAM. Built once before a fork and stored in one numpy buffer, its pages are shared
copy-on-write, and reading them copies nothing. Stored as millions of Python objects, it
is copied anyway, page by page, because reading an object writes its reference count.

:func:`forked_memory` measures this with real forked processes and ``psutil``: each
worker touches every sample while all workers are alive, then reports its RSS (all
resident pages), USS (pages only it holds) and PSS (shared pages split between sharers).
Nothing here touches the XLA device.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import psutil

MB = 1024 * 1024


def touch_all(data: Any) -> float:
    """Read every sample of ``data`` (numpy array, memmap, or list of rows); return a sum."""
    if data is None:
        return 0.0
    if isinstance(data, np.ndarray):
        return float(data.sum(dtype=np.float64))
    total = 0.0
    for row in data:  # sum() takes a reference to every element: a write to its page
        total += sum(row) if isinstance(row, list) else float(row.sum())
    return total


def _worker(build: Callable[[], Any] | None, shared: Any, barrier: Any, queue: Any) -> None:
    try:
        data = build() if build is not None else shared
        touch_all(data)
        barrier.wait(timeout=120)  # everyone has touched everything: measure while all alive
        info = psutil.Process().memory_full_info()
        queue.put({"pid": os.getpid(), "rss_mb": info.rss / MB, "uss_mb": info.uss / MB,
                   "pss_mb": info.pss / MB})
        barrier.wait(timeout=120)  # stay alive until every worker has measured
    except BaseException as exc:
        barrier.abort()  # release the others at once instead of letting them time out
        queue.put({"error": f"worker {os.getpid()}: {type(exc).__name__}: {exc}"})
        raise


def forked_memory(build: Callable[[], Any], *, before_fork: bool, processes: int = 4,
                  timeout: float = 180) -> list[dict[str, float]]:
    """Fork ``processes`` workers that each read the whole dataset; return their memory.

    ``before_fork=True`` calls ``build()`` once in this process and the workers inherit
    the result; ``False`` makes every worker call ``build()`` itself. One dict per worker:
    ``pid``, ``rss_mb``, ``uss_mb``, ``pss_mb``. Linux (fork + /proc smaps) only.
    """
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(processes)
    queue = ctx.Queue()
    shared = build() if before_fork else None
    procs = [ctx.Process(target=_worker, args=(None if before_fork else build, shared,
                                                barrier, queue), daemon=True)
             for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        rows = [queue.get(timeout=timeout) for _ in procs]
        errors = [r["error"] for r in rows if "error" in r]
        if errors:
            raise RuntimeError("memory measurement failed: " + "; ".join(errors))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"memory workers exited with codes {bad}")
    return sorted(rows, key=lambda r: r["pid"])


def memory_table(experiments: dict[str, tuple[Callable[[], Any], bool]],
                 processes: int) -> Any:
    """One row per experiment ``name: (build, before_fork)``: the mean RSS, USS and PSS
    (MB) of its ``processes`` workers, and ``uss_extra_mb``: USS above the first row's
    (the baseline: a worker holding no dataset)."""
    rows = {}
    for name, (build, before_fork) in experiments.items():
        per_process = pd.DataFrame(forked_memory(build, before_fork=before_fork,
                                                 processes=processes))
        rows[name] = per_process[["rss_mb", "uss_mb", "pss_mb"]].mean()
    table = pd.DataFrame(rows).T
    table["uss_extra_mb"] = table.uss_mb - table.uss_mb.iloc[0]
    return table
