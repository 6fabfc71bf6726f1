"""Count what XLA did inside a block: compiles, executions, transfers, CPU fallbacks, and why.

Taught in ``notebooks/05_performance_debugging.ipynb`` (finding recompiles, host syncs and
CPU fallbacks) and first shown in ``notebooks/00_environment.ipynb`` (lazy execution); the
other notebooks and the benchmarks use :func:`track` to assert "no recompiles after warm-up".

* :func:`metrics_frame` / :func:`metrics_delta`: the ``torch_xla.debug.metrics`` report as a
  pandas DataFrame, and the difference between two of them.
* :func:`track`: a context manager for your own code that counts compiles, executions,
  device-to-host transfers and CPU-fallback ops in a block, enforces limits, and on a
  violation raises :class:`LimitExceeded` naming what happened: the counts, the fallback
  ops by name, the Python line of each host read (``.item()``, ``print(t)``, ``if t:``) and,
  when :func:`enable_compile_analysis` was called first, each compile's cause, graph hash
  and Python frame (torch_xla's ``PT_XLA_DEBUG_LEVEL`` compile analysis).
* :func:`measure_steps`: run a training step over batches and report, after warm-up,
  compiles, executions, transfers and CPU fallbacks per step (the table of notebook 05).
* :func:`parse_compile_analysis`: read ``PT_XLA_DEBUG_LEVEL`` output (a file or the stderr
  of a process) into :class:`CompileCause` records.

All numbers come from ``torch_xla.debug.metrics``. Importing this module does not touch the
XLA device.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

#: How many compiles / host-read places an error message lists.
_MAX_LISTED = 8
#: ``aten::_local_scalar_dense`` is ``.item()`` itself (a transfer), not a missing lowering.
_NOT_A_FALLBACK = frozenset({"aten::_local_scalar_dense"})


@dataclass(frozen=True)
class Counts:
    """A snapshot (or a difference of two snapshots) of the counters that matter."""

    compiles: int = 0
    executions: int = 0
    transfers_to_device: int = 0
    transfers_from_device: int = 0
    fallback_ops: int = 0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _metric_count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return int(data[0]) if data else 0


def fallback_op_counts() -> dict[str, int]:
    """How often each op ran on the CPU because XLA has no lowering for it (``aten::*``)."""
    import torch_xla.debug.metrics as met

    return {n: int(met.counter_value(n) or 0) for n in met.counter_names()
            if n.startswith("aten::") and n not in _NOT_A_FALLBACK}


def snapshot() -> Counts:
    """Current totals since the process started (or since ``met.clear_all()``)."""
    return Counts(
        compiles=_metric_count("CompileTime"),
        executions=_metric_count("ExecuteTime"),
        transfers_to_device=_metric_count("TransferToDeviceTime"),
        transfers_from_device=_metric_count("TransferFromDeviceTime"),
        fallback_ops=sum(fallback_op_counts().values()),
    )


# --------------------------------------------------------------------------- DataFrames

_METRIC_BLOCK = re.compile(r"^Metric: (\S+)\n\s+TotalSamples: \d+\n\s+Accumulator: (\S+)", re.M)


def _units_from_report(report: str) -> dict[str, str]:
    """Metric name -> unit ("s", "bytes" or "") read from the text report's Accumulator."""
    units = {}
    for name, acc in _METRIC_BLOCK.findall(report):
        if acc.endswith("B"):
            units[name] = "bytes"
        elif acc.endswith("s"):
            units[name] = "s"
        else:
            units[name] = ""
    return units


def _settle() -> None:
    """Wait for queued executions (their metrics are posted when they finish), if any."""
    import torch_xla

    if torch_xla._XLAC._xla_runtime_is_initialized():
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


def metrics_frame(settle: bool = True) -> pd.DataFrame:
    """The full ``torch_xla`` metrics report as a DataFrame, one row per counter / metric.

    Index ``name``; columns ``kind`` ("counter" or "metric"), ``count`` (a counter's value,
    or how many samples a metric recorded, e.g. number of compiles for ``CompileTime``),
    ``total`` (a metric's accumulated value: seconds for times, bytes for data sizes;
    NaN for counters) and ``unit``. With ``settle`` it first waits for queued device work:
    executions are asynchronous and ``ExecuteTime`` is recorded when one finishes (even
    ``.item()`` can return before that).
    """
    import pandas as pd
    import torch_xla.debug.metrics as met

    if settle:
        _settle()

    units = _units_from_report(met.metrics_report())
    rows = []
    for name in met.counter_names():
        rows.append({"name": name, "kind": "counter", "count": int(met.counter_value(name) or 0),
                     "total": float("nan"), "unit": ""})
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
    import pandas as pd

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
            if not _is_library_path(frame):
                return frame
        return self.frames[0] if self.frames else "?"

    def describe(self) -> str:
        return f"graph {self.graph_hash[:12]} ({self.cause}) at {self.user_frame}"


_LIBRARY_DIRS: tuple[str, ...] | None = None


def _library_dirs() -> tuple[str, ...]:
    """torch's and torch_xla's package folders (frames there are not "your code")."""
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        dirs = []
        for mod in ("torch", "torch_xla"):
            spec = importlib.util.find_spec(mod)
            for location in (spec.submodule_search_locations or []) if spec else []:
                dirs.append(os.path.abspath(location) + os.sep)
        _LIBRARY_DIRS = tuple(dirs)
    return _LIBRARY_DIRS


def _is_library_path(text: str) -> bool:
    return __file__ in text or any(d in text for d in _library_dirs())


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
        line = raw[len(prefix):]
        body = line.strip()
        if body.startswith("=") or body.startswith("-"):
            if body.startswith("-") and (cause or ghash):
                causes.append(CompileCause(" ".join(cause), ghash, tuple(frames)))
                section, cause, ghash, frames = None, [], "", []
            continue
        if body in (f"{kind} Cause", "Compilation Cause", "Execution Cause"):
            section = "cause"
        elif body.startswith("Graph Info"):
            section = "graph"
        elif body.startswith("Python Frame Triggered Execution"):
            section = "frames"
        elif section == "cause":
            cause.append(body)
        elif section == "graph" and body.startswith("Graph Hash:"):
            ghash = body.split(":", 1)[1].strip()
        elif section == "frames" and body:
            frames.append(body)
    return causes


def enable_compile_analysis(path: str | Path | None = None) -> Path:
    """Turn on torch_xla's compile analysis for this process, written to a file we can read.

    Sets ``PT_XLA_DEBUG_LEVEL=1`` and ``PT_XLA_DEBUG_FILE``. torch_xla reads both once, at
    the first compile of the process, so call this before anything compiles (in a notebook:
    in the config cell). Afterwards :func:`track` names each compile's cause, graph hash and
    Python frame. Returns the file's path. Raises ``RuntimeError`` if the process already
    compiled (then it could not take effect: restart and call it first).
    """
    current = os.environ.get("PT_XLA_DEBUG_FILE")
    if _debug_level() >= 1 and current and (path is None or Path(path) == Path(current)):
        return Path(current)
    if "torch_xla" in sys.modules and _metric_count("CompileTime") > 0:
        raise RuntimeError(
            "enable_compile_analysis() must run before the first XLA compile of the process "
            "(torch_xla reads PT_XLA_DEBUG_LEVEL once, at the first compile): restart the "
            "kernel/process and call it first."
        )
    if path is None:
        fd, name = tempfile.mkstemp(prefix="pt_xla_compile_analysis_", suffix=".txt")
        os.close(fd)
        path = name
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.touch()
    os.environ["PT_XLA_DEBUG_LEVEL"] = "1"
    os.environ["PT_XLA_DEBUG_FILE"] = str(target)
    return target


def _debug_level() -> int:
    try:
        return int(os.environ.get("PT_XLA_DEBUG_LEVEL", "0") or 0)
    except ValueError:
        return 0


def _analysis_file() -> Path | None:
    path = os.environ.get("PT_XLA_DEBUG_FILE")
    if _debug_level() >= 1 and path:
        return Path(path)
    return None


def _file_size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


# --------------------------------------------------------------------------- host syncs


@dataclass(frozen=True)
class HostSync:
    """A read of an XLA tensor's value on the host: what was called, and where."""

    op: str
    where: str


#: Tensor methods that read an XLA tensor's value on the host (a device-to-host transfer,
#: and a graph cut if the value was not computed yet).
_HOST_READS = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "__repr__", "__format__", "__array__",
})


def _user_frame(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library_path(filename):
            return f"{frame.f_code.co_name} ({filename}:{frame.f_lineno})"
        frame = frame.f_back
    return "?"


def _is_xla(obj: Any) -> bool:
    device = getattr(obj, "device", None)
    return getattr(device, "type", None) == "xla"


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    for value in (*args[1:], kwargs.get("device")):
        if value is None:
            continue
        if str(value).startswith("cpu") or getattr(value, "type", None) == "cpu":
            return True
    return False


def _host_sync_recorder(sink: list[HostSync]):
    """A TorchFunctionMode that appends a :class:`HostSync` for every host read of an XLA
    tensor made by the code it wraps (nested calls inside torch are not double counted)."""
    from torch.overrides import TorchFunctionMode

    class _Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if args and _is_xla(args[0]) and (
                name in _HOST_READS or (name == "to" and _targets_cpu(args, kwargs))
            ):
                op = "print/str" if name in ("__repr__", "__format__") else (
                    f"{name}()" if not name.startswith("__") else name.strip("_") + "()")
                sink.append(HostSync(op=op, where=_user_frame(2)))
            return func(*args, **kwargs)

    return _Recorder()


# --------------------------------------------------------------------------- track


class LimitExceeded(AssertionError):
    """Raised by :func:`track` when a block did more than its limits allow."""


@dataclass
class Tracked:
    """Filled in when the ``with track() as t:`` block ends.

    ``counts``: :class:`Counts` for the block; ``fallback_ops``: op name -> times it ran on
    the CPU; ``compile_causes``: one :class:`CompileCause` per compile (only when
    :func:`enable_compile_analysis` is on); ``host_syncs``: each host read of an XLA tensor
    (only when host syncs are recorded); ``report``: :func:`metrics_delta` of the block.
    """

    counts: Counts = Counts()
    fallback_ops: dict[str, int] = field(default_factory=dict)
    compile_causes: list[CompileCause] = field(default_factory=list)
    host_syncs: list[HostSync] = field(default_factory=list)
    report: Any = None
    compile_analysis_on: bool = False

    def explain(self) -> str:
        """Everything known about what the block did, one fact per line."""
        c = self.counts
        lines = [
            f"counts: {c.compiles} compiles, {c.executions} executions, "
            f"{c.transfers_from_device} device-to-host transfers, "
            f"{c.transfers_to_device} host-to-device transfers, {c.fallback_ops} CPU-fallback ops"
        ]
        if self.fallback_ops:
            ops = ", ".join(f"{n} x{k}" for n, k in sorted(self.fallback_ops.items()))
            lines.append(f"ops that ran on the CPU (no XLA lowering): {ops}")
        if self.compile_causes:
            shown = self.compile_causes[:_MAX_LISTED]
            lines.append("compiles (torch_xla compile analysis):")
            lines += [f"  {i}. {cc.describe()}" for i, cc in enumerate(shown, 1)]
            if len(self.compile_causes) > len(shown):
                lines.append(f"  ... and {len(self.compile_causes) - len(shown)} more")
            graphs_at: dict[str, set[str]] = {}
            for cc in self.compile_causes:
                graphs_at.setdefault(cc.user_frame, set()).add(cc.graph_hash)
            for where, hashes in graphs_at.items():
                if len(hashes) > 1:
                    lines.append(
                        f"{len(hashes)} different graphs compiled at {where}: what is traced "
                        "there changes from call to call (input shapes, Python branches on "
                        "tensor values, or host reads cutting the graph)")
        elif c.compiles and not self.compile_analysis_on:
            lines.append("to see each compile's cause and Python frame, call "
                         "tpu_helpers.metrics.enable_compile_analysis() before the first "
                         "compile (it sets PT_XLA_DEBUG_LEVEL=1 and PT_XLA_DEBUG_FILE)")
        if self.host_syncs:
            grouped = Counter((h.op, h.where) for h in self.host_syncs)
            lines.append("host reads of XLA tensors (each one waits for the device):")
            lines += [f"  {k} x {op} at {where}"
                      for (op, where), k in grouped.most_common(_MAX_LISTED)]
        return "\n".join(lines)


@contextmanager
def track(
    max_compiles: int | None = None,
    max_transfers_from_device: int | None = None,
    max_fallback_ops: int | None = None,
    what: str = "this block",
    *,
    max_executions: int | None = None,
    record_host_syncs: bool | None = None,
    report: bool = False,
) -> Iterator[Tracked]:
    """Count compiles / executions / transfers / CPU fallbacks in a block; enforce limits.

    A limit of ``None`` is not checked; ``max_compiles=0`` means "no new compiles here".
    On a violation :class:`LimitExceeded` is raised after the block, naming the counts, the
    fallback ops, each compile's cause and frame (if :func:`enable_compile_analysis` is
    on) and the line of each host read (recorded when ``record_host_syncs`` is true;
    by default whenever ``max_transfers_from_device`` is set). ``report=True`` also fills
    ``t.report`` with the block's :func:`metrics_delta`.

    >>> with track(max_compiles=0, what="epoch 2") as t:   # doctest: +SKIP
    ...     train_one_epoch()
    >>> t.counts.executions                                 # doctest: +SKIP
    """
    if record_host_syncs is None:
        record_host_syncs = max_transfers_from_device is not None
    analysis = _analysis_file()
    _settle()  # executions are asynchronous: settle them before counting
    before = snapshot()
    before_ops = fallback_op_counts()
    before_frame = metrics_frame(settle=False) if report else None
    offset = _file_size(analysis)
    result = Tracked(compile_analysis_on=analysis is not None)
    recorder = _host_sync_recorder(result.host_syncs) if record_host_syncs else None
    if recorder is not None:
        with recorder:
            yield result
    else:
        yield result
    _settle()
    result.counts = snapshot() - before
    after_ops = fallback_op_counts()
    result.fallback_ops = {n: k - before_ops.get(n, 0) for n, k in after_ops.items()
                           if k - before_ops.get(n, 0) > 0}
    if before_frame is not None:
        result.report = metrics_delta(before_frame, metrics_frame(settle=False))
    if analysis is not None and result.counts.compiles:
        with open(analysis, encoding="utf-8", errors="replace") as fh:
            fh.seek(offset)
            result.compile_causes = parse_compile_analysis(fh.read())
    c = result.counts
    limits = [(max_compiles, c.compiles, "compiles"),
              (max_executions, c.executions, "executions"),
              (max_transfers_from_device, c.transfers_from_device, "device-to-host transfers"),
              (max_fallback_ops, c.fallback_ops, "CPU-fallback ops")]
    broken = [f"{n} {label} (limit {limit})" for limit, n, label in limits
              if limit is not None and n > limit]
    if broken:
        raise LimitExceeded(f"{what}: " + "; ".join(broken) + ".\n" + result.explain()
                            + f"\nAll counts: {c.as_dict()}")


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
    graph as a constant until a sync turns it into device data), so a healthy loop may
    compile twice before it settles. Each step should end the way your loop does (e.g.
    with ``torch_xla.sync()``); the time includes waiting for the device at the end.
    """
    import time

    import torch_xla.core.xla_model as xm

    if len(batches) <= warmup:
        raise ValueError(f"measure_steps needs more than {warmup} batches, got {len(batches)}")
    xm.wait_device_ops()
    start = time.perf_counter()
    for batch in batches[:warmup]:
        step(*batch)
    xm.wait_device_ops()
    warm = time.perf_counter() - start
    with track() as t:
        start = time.perf_counter()
        for batch in batches[warmup:]:
            step(*batch)
        xm.wait_device_ops()
        seconds = time.perf_counter() - start
    return StepCost(steps=len(batches) - warmup, seconds=seconds, warmup_seconds=warm,
                    counts=t.counts, fallback_ops=t.fallback_ops)
