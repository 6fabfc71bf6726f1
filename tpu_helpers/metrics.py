"""A guard for your own loops: count what XLA did in a block and fail when it recompiles.

Taught in ``notebooks/05_performance_debugging.ipynb``; first shown in notebook 00. Needs no
sibling: copy this file alone (torch, torch_xla, the standard library).

:func:`snapshot` reads compiles, executions, transfers and CPU-fallback ops from
``torch_xla.debug.metrics`` into :class:`Counts`; :func:`track` counts a ``with`` block,
enforces limits (``max_compiles=0`` after warm-up) and on a violation raises
:class:`LimitExceeded` naming the counts, the fallback ops and the Python line of each
host read (``.item()``, ``print(t)``, ``if t:``). Importing this module neither touches
the XLA device nor imports torch_xla (whose import picks a default ``PJRT_DEVICE``): the
``torch_xla`` imports are deferred into the functions that read counters.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from torch.overrides import TorchFunctionMode

#: How many host-read places an error message lists.
_MAX_LISTED = 8
#: ``aten::_local_scalar_dense`` is ``.item()`` itself (a transfer), not a missing lowering.
_NOT_A_FALLBACK = frozenset({"aten::_local_scalar_dense"})
#: Executions: ``ExecuteTime`` for one device per process, ``ExecuteReplicatedTime`` under SPMD.
_EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")


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
    import torch_xla.debug.metrics as met  # deferred: importing this file stays device-free

    data = met.metric_data(name)
    return int(data[0]) if data else 0


def fallback_op_counts() -> dict[str, int]:
    """How often each op ran on the CPU because XLA has no lowering for it (``aten::*``)."""
    import torch_xla.debug.metrics as met  # deferred: see the module docstring

    return {n: int(met.counter_value(n) or 0) for n in met.counter_names()
            if n.startswith("aten::") and n not in _NOT_A_FALLBACK}


def snapshot() -> Counts:
    """Current totals since the process started (or since ``met.clear_all()``).

    Executions sum ``ExecuteTime`` and ``ExecuteReplicatedTime`` (SPMD records there).
    """
    return Counts(
        compiles=_metric_count("CompileTime"),
        executions=sum(_metric_count(n) for n in _EXECUTE_METRICS),
        transfers_to_device=_metric_count("TransferToDeviceTime"),
        transfers_from_device=_metric_count("TransferFromDeviceTime"),
        fallback_ops=sum(fallback_op_counts().values()),
    )


def settle() -> None:
    """Wait for queued executions (their metrics are posted when they finish), if any."""
    import torch_xla  # deferred: see the module docstring

    if torch_xla._XLAC._xla_runtime_is_initialized():
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


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


def _library_dirs() -> tuple[str, ...]:
    """torch's and torch_xla's package folders (frames there are not "your code")."""
    dirs = []
    for mod in ("torch", "torch_xla"):
        spec = importlib.util.find_spec(mod)
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.abspath(location) + os.sep)
    return tuple(dirs)


_LIBRARY_DIRS = _library_dirs()


def is_library_path(text: str) -> bool:
    """True for a file (or a frame naming one) in torch, torch_xla or this module."""
    return __file__ in text or any(d in text for d in _LIBRARY_DIRS)


def _user_frame(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_path(filename):
            return f"{frame.f_code.co_name} ({filename}:{frame.f_lineno})"
        frame = frame.f_back
    return "?"


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    for value in (*args[1:], kwargs.get("device")):
        if value is not None and (str(value).startswith("cpu")
                                  or getattr(value, "type", None) == "cpu"):
            return True
    return False


def _op_label(name: str) -> str:
    if name in ("__repr__", "__format__"):
        return "print/str"
    return f"{name}()" if not name.startswith("__") else name.strip("_") + "()"


class _HostSyncRecorder(TorchFunctionMode):
    """Appends a :class:`HostSync` for every host read of an XLA tensor in the wrapped code
    (nested calls inside torch are not double counted: a mode is off inside its handler)."""

    def __init__(self, sink: list[HostSync]):
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        on_xla = args and getattr(getattr(args[0], "device", None), "type", None) == "xla"
        if on_xla and (
                name in _HOST_READS or (name == "to" and _targets_cpu(args, kwargs))):
            self.sink.append(HostSync(op=_op_label(name), where=_user_frame(2)))
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- track


class LimitExceeded(AssertionError):
    """Raised by :func:`track` when a block did more than its limits allow."""


@dataclass
class Tracked:
    """Filled in when the ``with track() as t:`` block ends: its :class:`Counts`, the
    fallback ops (name -> times), the host reads (when recorded), and the ``notes`` (lines
    for the message) and ``details`` an ``on_exit`` hook added."""

    counts: Counts = Counts()
    fallback_ops: dict[str, int] = field(default_factory=dict)
    host_syncs: list[HostSync] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

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
        lines += self.notes
        if c.compiles and not self.notes:
            lines.append(_analysis_hint())
        if self.host_syncs:
            grouped = Counter((h.op, h.where) for h in self.host_syncs)
            lines.append("host reads of XLA tensors (each one waits for the device):")
            lines += [f"  {k} x {op} at {where}"
                      for (op, where), k in grouped.most_common(_MAX_LISTED)]
        return "\n".join(lines)


def _analysis_hint() -> str:
    """Where torch_xla's compile analysis (each compile's cause and line) is, or how to get it."""
    if os.environ.get("PT_XLA_DEBUG_LEVEL", "0") not in ("", "0"):
        where = os.environ.get("PT_XLA_DEBUG_FILE") or "stderr"
        return (f"each compile's cause and Python line: the 'Compilation Analysis' blocks in "
                f"{where} (if PT_XLA_DEBUG_LEVEL was set before the first compile)")
    return ("to see each compile's cause and Python line, set PT_XLA_DEBUG_LEVEL=1 (and "
            "PT_XLA_DEBUG_FILE=path) before the first compile of the process")


def _broken_limits(c: Counts, limits: dict[str, int | None]) -> list[str]:
    labels = {"compiles": "compiles", "executions": "executions",
              "transfers_from_device": "device-to-host transfers",
              "fallback_ops": "CPU-fallback ops"}
    return [f"{getattr(c, name)} {labels[name]} (limit {limit})"
            for name, limit in limits.items() if limit is not None and getattr(c, name) > limit]


@contextmanager
def track(
    max_compiles: int | None = None,
    max_transfers_from_device: int | None = None,
    max_fallback_ops: int | None = None,
    what: str = "this block",
    *,
    max_executions: int | None = None,
    record_host_syncs: bool | None = None,
    on_exit: Callable[[Tracked], None] | None = None,
) -> Iterator[Tracked]:
    """Count compiles / executions / transfers / CPU fallbacks in a block; enforce limits.

    A limit of ``None`` is not checked; ``max_compiles=0`` means "no new compiles here".
    On a violation :class:`LimitExceeded` is raised after the block, naming the counts,
    the fallback ops and the line of each host read (recorded when ``record_host_syncs``
    is true; by default whenever ``max_transfers_from_device`` is set). ``on_exit(t)``
    runs after counting and before the limits are checked: it may add ``t.notes`` (lines
    for the message) and ``t.details``. An exception inside the block propagates as is.

    >>> with track(max_compiles=0, what="epoch 2") as t:   # doctest: +SKIP
    ...     train_one_epoch()
    >>> t.counts.executions                                 # doctest: +SKIP
    """
    if record_host_syncs is None:
        record_host_syncs = max_transfers_from_device is not None
    settle()  # executions are asynchronous: settle them before counting
    before, before_ops = snapshot(), fallback_op_counts()
    result = Tracked()
    if record_host_syncs:
        with _HostSyncRecorder(result.host_syncs):
            yield result
    else:
        yield result
    settle()
    result.counts = snapshot() - before
    result.fallback_ops = {n: k - before_ops.get(n, 0) for n, k in fallback_op_counts().items()
                           if k > before_ops.get(n, 0)}
    if on_exit is not None:
        on_exit(result)
    broken = _broken_limits(result.counts, {
        "compiles": max_compiles, "executions": max_executions,
        "transfers_from_device": max_transfers_from_device, "fallback_ops": max_fallback_ops})
    if broken:
        raise LimitExceeded(f"{what}: " + "; ".join(broken) + ".\n" + result.explain()
                            + f"\nAll counts: {result.counts.as_dict()}")
