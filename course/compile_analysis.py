"""Course-only analysis around the metrics guard: tables, compile causes, per-step cost.

Used by ``notebooks/05_performance_debugging.ipynb`` (and its tests). The guard a user
copies is :mod:`tpu_helpers.metrics` (``snapshot``, ``track``); this module adds what the
course shows on top of it:

* :func:`metrics_frame` / :func:`metrics_delta`: the ``torch_xla.debug.metrics`` report as
  a pandas DataFrame, and the difference between two of them.
* :func:`enable_compile_analysis` / :func:`parse_compile_analysis`: torch_xla's
  ``PT_XLA_DEBUG_LEVEL`` compile analysis written to a file and read back as
  :class:`CompileCause` records (cause, graph hash, Python frame).
* :func:`track_with_analysis`: :func:`tpu_helpers.metrics.track` whose
  ``LimitExceeded`` also names each compile's cause and frame, and whose result holds the
  block's metrics table (``t.details["report"]``) and causes (``t.details["compile_causes"]``).
* :func:`measure_steps` / :class:`StepCost`: a step's cost after warm-up; :func:`pitfall_table`:
  notebook 05's table of them.
* :func:`run_python`: a fresh Python process (notebook 05's ``PT_XLA_DEBUG_LEVEL=2`` and
  compile-cache children: settings a running process can no longer change).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch_xla.debug.metrics as met

from tpu_helpers.metrics import Counts, Tracked, is_library_path, settle, track

#: How many compiles an explanation lists.
_MAX_LISTED = 8

# --------------------------------------------------------------------------- DataFrames

_METRIC_BLOCK = re.compile(r"^Metric: (\S+)\n\s+TotalSamples: \d+\n\s+Accumulator: (\S+)", re.M)


def _units_from_report(report: str) -> dict[str, str]:
    """Metric name -> unit ("s", "bytes" or "") read from the text report's Accumulator."""
    units = {}
    for name, acc in _METRIC_BLOCK.findall(report):
        units[name] = "bytes" if acc.endswith("B") else "s" if acc.endswith("s") else ""
    return units


def metrics_frame(settle_first: bool = True) -> pd.DataFrame:
    """The full ``torch_xla`` metrics report as a DataFrame, one row per counter / metric.

    Index ``name``; columns ``kind`` ("counter" or "metric"), ``count`` (a counter's value,
    or how many samples a metric recorded, e.g. number of compiles for ``CompileTime``),
    ``total`` (a metric's accumulated value: seconds for times, bytes for data sizes;
    NaN for counters) and ``unit``. With ``settle_first`` it first waits for queued device
    work: ``ExecuteTime`` is recorded when an execution finishes.
    """
    if settle_first:
        settle()
    units = _units_from_report(met.metrics_report())
    rows = [{"name": name, "kind": "counter", "count": int(met.counter_value(name) or 0),
             "total": float("nan"), "unit": ""} for name in met.counter_names()]
    for name in met.metric_names():
        data = met.metric_data(name)
        if not data:
            continue
        unit = units.get(name, "")
        total = float(data[1]) / 1e9 if unit == "s" else float(data[1])
        rows.append({"name": name, "kind": "metric", "count": int(data[0]), "total": total,
                     "unit": unit})
    frame = pd.DataFrame(rows, columns=["name", "kind", "count", "total", "unit"])
    return frame.set_index("name").sort_values(["kind", "name"])


def metrics_delta(before: pd.DataFrame, after: pd.DataFrame,
                  changed_only: bool = True) -> pd.DataFrame:
    """``after - before`` for two :func:`metrics_frame` results (rows new in ``after``
    count from zero). With ``changed_only`` the rows whose count did not move are dropped.
    """
    names = after.index.union(before.index)
    a = after.reindex(names)
    b = before.reindex(names)
    delta = pd.DataFrame({
        "kind": a["kind"].fillna(b["kind"]),
        "count": (a["count"].fillna(0) - b["count"].fillna(0)).astype(int),
        "total": a["total"] - b["total"].where(b["total"].notna(), 0.0),
        "unit": a["unit"].fillna(b["unit"]),
    }, index=names)
    delta.index.name = "name"
    if changed_only:
        delta = delta[delta["count"] != 0]
    return delta.sort_values(["kind", "name"])


# --------------------------------------------------------------------------- compile causes


@dataclass(frozen=True)
class CompileCause:
    """One compile as torch_xla's ``PT_XLA_DEBUG_LEVEL`` compile analysis describes it."""

    cause: str
    graph_hash: str
    frames: tuple[str, ...] = ()

    @property
    def user_frame(self) -> str:
        """The first Python frame outside torch / torch_xla (where your code was)."""
        for frame in self.frames:
            if not is_library_path(frame) and __file__ not in frame:
                return frame
        return self.frames[0] if self.frames else "?"

    def describe(self) -> str:
        return f"graph {self.graph_hash[:12]} ({self.cause}) at {self.user_frame}"


_SECTIONS = {"Graph Info": "graph", "Python Frame Triggered Execution": "frames"}


def parse_compile_analysis(text: str, kind: str = "Compilation") -> list[CompileCause]:
    """Parse the ``Compilation Analysis:`` blocks torch_xla writes at ``PT_XLA_DEBUG_LEVEL>=1``.

    ``text`` is that output (from ``PT_XLA_DEBUG_FILE`` or a process's stderr). With
    ``kind="Execution"`` the ``Execution Analysis:`` blocks (level 2) are parsed instead.
    """
    prefix = f"{kind} Analysis:"
    causes: list[CompileCause] = []
    section, cause, ghash, frames = None, [], "", []
    for raw in text.splitlines():
        if not raw.startswith(prefix):
            continue
        body = raw[len(prefix):].strip()
        if body.startswith("-") and (cause or ghash):  # the end of one block
            causes.append(CompileCause(" ".join(cause), ghash, tuple(frames)))
            section, cause, ghash, frames = None, [], "", []
        elif body.startswith(("=", "-")):
            continue
        elif body == f"{kind} Cause":
            section = "cause"
        elif any(body.startswith(head) for head in _SECTIONS):
            section = next(s for head, s in _SECTIONS.items() if body.startswith(head))
        elif section == "cause":
            cause.append(body)
        elif section == "graph" and body.startswith("Graph Hash:"):
            ghash = body.split(":", 1)[1].strip()
        elif section == "frames" and body:
            frames.append(body)
    return causes


def _debug_level() -> int:
    try:
        return int(os.environ.get("PT_XLA_DEBUG_LEVEL", "0") or 0)
    except ValueError:
        return 0


def analysis_file() -> Path | None:
    """The compile-analysis file torch_xla writes in this process, if any."""
    path = os.environ.get("PT_XLA_DEBUG_FILE")
    return Path(path) if _debug_level() >= 1 and path else None


def enable_compile_analysis(path: str | Path | None = None) -> Path:
    """Turn on torch_xla's compile analysis for this process, written to a file we can read.

    Sets ``PT_XLA_DEBUG_LEVEL=1`` and ``PT_XLA_DEBUG_FILE``. torch_xla reads both once, at
    the first compile of the process, so call this before anything compiles (in a notebook:
    in the config cell). Raises ``RuntimeError`` if the process already compiled.
    """
    current = analysis_file()
    if current and (path is None or Path(path) == current):
        return current
    if "torch_xla" in sys.modules and met.metric_data("CompileTime"):
        raise RuntimeError(
            "enable_compile_analysis() must run before the first XLA compile of the process "
            "(torch_xla reads PT_XLA_DEBUG_LEVEL once, at the first compile): restart the "
            "kernel/process and call it first.")
    if path is None:
        fd, path = tempfile.mkstemp(prefix="pt_xla_compile_analysis_", suffix=".txt")
        os.close(fd)
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.touch()
    os.environ["PT_XLA_DEBUG_LEVEL"] = "1"
    os.environ["PT_XLA_DEBUG_FILE"] = str(target)
    return target


def explain_causes(causes: list[CompileCause]) -> list[str]:
    """Lines naming each compile, and places that compiled more than one graph."""
    shown = causes[:_MAX_LISTED]
    lines = ["compiles (torch_xla compile analysis):"]
    lines += [f"  {i}. {cc.describe()}" for i, cc in enumerate(shown, 1)]
    if len(causes) > len(shown):
        lines.append(f"  ... and {len(causes) - len(shown)} more")
    graphs_at: dict[str, set[str]] = {}
    for cc in causes:
        graphs_at.setdefault(cc.user_frame, set()).add(cc.graph_hash)
    lines += [f"{len(hashes)} different graphs compiled at {where}: what is traced there "
              "changes from call to call (input shapes, Python branches on tensor values, "
              "or host reads cutting the graph)"
              for where, hashes in graphs_at.items() if len(hashes) > 1]
    return lines


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


@contextmanager
def track_with_analysis(*args: Any, report: bool = False, **kwargs: Any) -> Iterator[Tracked]:
    """:func:`tpu_helpers.metrics.track` (same arguments) plus the compile analysis.

    When :func:`enable_compile_analysis` is on, ``t.details["compile_causes"]`` holds one
    :class:`CompileCause` per compile of the block and a ``LimitExceeded`` names them.
    With ``report=True``, ``t.details["report"]`` is the block's :func:`metrics_delta`.
    """
    path = analysis_file()
    settle()
    offset, before = _size(path), metrics_frame(False) if report else None

    def add_analysis(t: Tracked) -> None:
        if before is not None:
            t.details["report"] = metrics_delta(before, metrics_frame(False))
        if path is None or not t.counts.compiles:
            return
        with open(path, encoding="utf-8", errors="replace") as fh:
            fh.seek(offset)
            causes = parse_compile_analysis(fh.read())
        t.details["compile_causes"] = causes
        t.notes += explain_causes(causes) if causes else []

    with track(*args, on_exit=add_analysis, **kwargs) as t:
        yield t


# --------------------------------------------------------------------------- per-step cost


@dataclass(frozen=True)
class StepCost:
    """What a loop cost per step after its warm-up steps (see :func:`measure_steps`)."""

    steps: int
    seconds: float
    warmup_seconds: float
    counts: Counts
    fallback_ops: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, float]:
        """One table row: compiles after warm-up, then per-step averages."""
        n = max(self.steps, 1)
        c = self.counts
        return {
            "compiles after warm-up": c.compiles,
            "executions/step": c.executions / n,
            "device-to-host/step": c.transfers_from_device / n,
            "CPU fallbacks/step": c.fallback_ops / n,
            "ms/step": 1e3 * self.seconds / n,
            "warm-up ms": 1e3 * self.warmup_seconds,
        }


def measure_steps(step: Callable[..., object], batches: Sequence[Sequence[Any]],
                  warmup: int = 2) -> StepCost:
    """Run ``step(*batch)`` for every batch; count and time all but the first ``warmup``.

    Two warm-up steps by default: the first step often traces a different graph than the
    rest (optimizer state is created; a 0-dim tensor holding 0 or 1 is baked into the
    graph as a constant until a sync turns it into device data). Each step should end the
    way your loop does (e.g. ``torch_xla.sync()``); the time includes waiting for the device.
    """
    if len(batches) <= warmup:
        raise ValueError(f"measure_steps needs more than {warmup} batches, got {len(batches)}")
    settle()
    start = time.perf_counter()
    for batch in batches[:warmup]:
        step(*batch)
    settle()
    warm = time.perf_counter() - start
    with track() as t:
        start = time.perf_counter()
        for batch in batches[warmup:]:
            step(*batch)
        settle()
        seconds = time.perf_counter() - start
    return StepCost(steps=len(batches) - warmup, seconds=seconds, warmup_seconds=warm,
                    counts=t.counts, fallback_ops=t.fallback_ops)


#: The four counts of notebook 05's pitfall table, in column order (``StepCost.row``'s keys).
PITFALL_COUNTS = ["compiles after warm-up", "executions/step", "device-to-host/step",
                  "CPU fallbacks/step"]


def pitfall_table(results: dict[tuple[str, str], StepCost]) -> pd.DataFrame:
    """Notebook 05's table: one row per ``(pitfall, version)`` key of ``results`` (version
    ``"pitfall"`` or ``"fixed"``), the columns of :meth:`StepCost.row` but the warm-up time."""
    table = pd.DataFrame({key: cost.row() for key, cost in results.items()}).T
    return table.drop(columns="warm-up ms").rename_axis(["pitfall", "version"])

# --------------------------------------------------------------------------- child processes

#: The folder holding ``course`` and ``tpu_helpers``, so that a child process imports them too.
_REPO = str(Path(__file__).resolve().parent.parent)


def run_python(script: str, *args: object, timeout: float = 300,
               **env: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh Python with this process's environment plus ``env`` (a value
    of None removes a variable) and ``args`` as ``sys.argv[1:]``; return the finished process.

    The child can import this repository (its folder is put first on ``PYTHONPATH``, which
    keeps what was there). Raises ``RuntimeError`` with the end of its stderr if it fails.
    """
    full = {**os.environ, **env}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, full.get("PYTHONPATH")) if p)
    full = {k: v for k, v in full.items() if v is not None}
    child = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=full,
                           capture_output=True, text=True, timeout=timeout)
    if child.returncode:
        raise RuntimeError(f"the child process failed ({child.returncode}):\n"
                           f"{child.stderr[-3000:]}")
    return child
