"""A guard for your own loops: count what XLA did in a block and fail when it recompiles.

Taught in notebook 05 (first shown in 00). Copy this file alone. Importing it neither touches
the device nor imports torch_xla (which picks a default ``PJRT_DEVICE``).
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


def metric_count(name: str) -> int:
    """How many samples the metric ``name`` recorded (for ``CompileTime``: compiles), 0 if none."""
    import torch_xla.debug.metrics as met  # deferred: importing this file stays device-free

    data = met.metric_data(name)  # (number of samples, their total, recent samples) or None
    return int(data[0]) if data else 0


def fallback_op_counts() -> dict[str, int]:
    """How often each op ran on the CPU because XLA has no lowering for it (``aten::*``;
    ``aten::_local_scalar_dense`` is ``.item()`` itself, a transfer)."""
    import torch_xla.debug.metrics as met

    return {n: int(met.counter_value(n) or 0) for n in met.counter_names()
            if n.startswith("aten::") and n != "aten::_local_scalar_dense"}


def snapshot() -> Counts:
    """Totals since the process started (or ``met.clear_all()``); executions sum
    ``ExecuteTime`` and ``ExecuteReplicatedTime`` (where SPMD records them)."""
    return Counts(
        compiles=metric_count("CompileTime"),
        executions=metric_count("ExecuteTime") + metric_count("ExecuteReplicatedTime"),
        transfers_to_device=metric_count("TransferToDeviceTime"),
        transfers_from_device=metric_count("TransferFromDeviceTime"),
        fallback_ops=sum(fallback_op_counts().values()),
    )


def settle() -> None:
    """Wait for queued executions (their metrics are posted when they finish), if any."""
    import torch_xla

    if torch_xla._XLAC._xla_runtime_is_initialized():
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


@dataclass(frozen=True)
class HostSync:
    """A read of an XLA tensor's value on the host: what was called, and where."""

    op: str
    where: str


#: Tensor methods that read an XLA tensor's value on the host (a transfer, and a graph cut).
_HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__",
                         "__index__", "__repr__", "__format__", "__array__"})
_LIBRARY_DIRS = tuple(os.path.abspath(location) + os.sep for mod in ("torch", "torch_xla")
                      for spec in [importlib.util.find_spec(mod)] if spec
                      for location in spec.submodule_search_locations or [])


def is_library_path(text: str) -> bool:
    """True for a file (or a frame naming one) in torch, torch_xla or this module."""
    return __file__ in text or any(d in text for d in _LIBRARY_DIRS)


class _HostSyncRecorder(TorchFunctionMode):
    """Appends a :class:`HostSync` for every host read of an XLA tensor in the wrapped code
    (nested calls inside torch are not double counted: a mode is off inside its handler)."""

    def __init__(self, sink: list[HostSync]):
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and getattr(getattr(args[0], "device", None), "type", None) == "xla" and (
                name in _HOST_READS or name == "to" and any(
                    str(v).startswith("cpu") or getattr(v, "type", None) == "cpu"
                    for v in (*args[1:], kwargs.get("device")) if v is not None)):
            frame, where = sys._getframe(1), "?"
            while frame is not None and is_library_path(frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None:
                where = f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
            op = "print/str" if name in ("__repr__", "__format__") else name.strip("_") + "()"
            self.sink.append(HostSync(op=op, where=where))
        return func(*args, **kwargs)


class LimitExceeded(AssertionError):
    """Raised by :func:`track` when a block did more than its limits allow."""


@dataclass
class Tracked:
    """Filled in when the ``with track() as t:`` block ends; an ``on_exit`` hook may add
    ``notes`` (lines for the message) and ``details``."""

    counts: Counts = Counts()
    fallback_ops: dict[str, int] = field(default_factory=dict)
    host_syncs: list[HostSync] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def explain(self) -> str:
        """Everything known about what the block did, one fact per line."""
        c = self.counts
        lines = [f"counts: {c.compiles} compiles, {c.executions} executions, "
                 f"{c.transfers_from_device} device-to-host transfers, {c.transfers_to_device} "
                 f"host-to-device transfers, {c.fallback_ops} CPU-fallback ops"]
        if self.fallback_ops:
            ops = ", ".join(f"{n} x{k}" for n, k in sorted(self.fallback_ops.items()))
            lines.append(f"ops that ran on the CPU (no XLA lowering): {ops}")
        lines += self.notes
        analysis_on = os.environ.get("PT_XLA_DEBUG_LEVEL", "0") not in ("", "0")
        if c.compiles and not self.notes and analysis_on:
            lines.append("each compile's cause and Python line: the 'Compilation Analysis' "
                         f"blocks in {os.environ.get('PT_XLA_DEBUG_FILE') or 'stderr'} (if "
                         "PT_XLA_DEBUG_LEVEL was set before the first compile)")
        elif c.compiles and not self.notes:
            lines.append("to see each compile's cause and Python line, set PT_XLA_DEBUG_LEVEL=1"
                         " (and PT_XLA_DEBUG_FILE=path) before the first compile of the process")
        if self.host_syncs:
            grouped = Counter((h.op, h.where) for h in self.host_syncs)
            lines.append("host reads of XLA tensors (each one waits for the device):")
            lines += [f"  {k} x {op} at {where}" for (op, where), k in grouped.most_common(8)]
        return "\n".join(lines)


@contextmanager
def track(max_compiles: int | None = None, max_transfers_from_device: int | None = None,
          max_fallback_ops: int | None = None, what: str = "this block", *,
          max_executions: int | None = None, record_host_syncs: bool | None = None,
          on_exit: Callable[[Tracked], None] | None = None) -> Iterator[Tracked]:
    """Count compiles / executions / transfers / CPU fallbacks in a block; enforce limits.

    A limit of ``None`` is not checked (``max_compiles=0``: no new compiles). Host reads are
    recorded when ``record_host_syncs`` (default: when ``max_transfers_from_device`` is set).
    ``on_exit(t)`` runs after counting, before the limits are checked, and may add
    ``t.notes`` and ``t.details``. An exception inside the block propagates as is.
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
    result.counts = c = snapshot() - before
    result.fallback_ops = {n: k - before_ops.get(n, 0) for n, k in fallback_op_counts().items()
                           if k > before_ops.get(n, 0)}
    if on_exit is not None:
        on_exit(result)
    limits = ((c.compiles, "compiles", max_compiles), (c.executions, "executions", max_executions),
              (c.transfers_from_device, "device-to-host transfers", max_transfers_from_device),
              (c.fallback_ops, "CPU-fallback ops", max_fallback_ops))
    broken = [f"{n} {label} (limit {limit})" for n, label, limit in limits
              if limit is not None and n > limit]
    if broken:
        raise LimitExceeded(f"{what}: " + "; ".join(broken) + ".\n" + result.explain()
                            + f"\nAll counts: {c.as_dict()}")


def hlo_text(tensors) -> str:
    """The HLO text of the graph that would compute ``tensors`` (nothing runs): count an op in it,
    e.g. ``hlo_text(grads).count("opt-barrier")``. torch_xla has no public call for this; it is
    the private ``torch_xla._XLAC._get_xla_tensors_hlo`` (v2.8.0 and v2.9.0), kept here."""
    import torch_xla  # deferred: importing this file stays device-free

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))
