"""Count what XLA did inside a block: compiles, executions, transfers, CPU fallbacks.

Taught in ``notebooks/00_environment.ipynb`` (lazy execution) and
``notebooks/05_performance_debugging.ipynb`` (finding recompiles and host syncs); the
other notebooks use :func:`track` to assert "no recompiles after warm-up".

All numbers come from ``torch_xla.debug.metrics``. Importing this module does not touch
the XLA device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields


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


def snapshot() -> Counts:
    """Current totals since the process started (or since ``met.clear_all()``)."""
    import torch_xla.debug.metrics as met

    # aten::_local_scalar_dense is `.item()` itself: a transfer, counted as one below.
    fallbacks = sum(int(met.counter_value(n) or 0) for n in met.counter_names()
                    if n.startswith("aten::") and n != "aten::_local_scalar_dense")
    return Counts(
        compiles=_metric_count("CompileTime"),
        executions=_metric_count("ExecuteTime"),
        transfers_to_device=_metric_count("TransferToDeviceTime"),
        transfers_from_device=_metric_count("TransferFromDeviceTime"),
        fallback_ops=fallbacks,
    )


class LimitExceeded(AssertionError):
    """Raised by :func:`track` when a block did more than its limits allow."""


@dataclass
class Tracked:
    """Filled in when the ``with track() as t:`` block ends: ``t.counts``."""

    counts: Counts = Counts()


@contextmanager
def track(
    max_compiles: int | None = None,
    max_transfers_from_device: int | None = None,
    max_fallback_ops: int | None = None,
    what: str = "this block",
) -> Iterator[Tracked]:
    """Count compiles / executions / transfers / fallbacks in a block; enforce limits.

    >>> with track(max_compiles=0, what="epoch 2") as t:   # doctest: +SKIP
    ...     train_one_epoch()
    >>> t.counts.executions                                 # doctest: +SKIP
    """
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # executions are asynchronous: settle them before counting
    before = snapshot()
    result = Tracked()
    yield result
    xm.wait_device_ops()
    result.counts = snapshot() - before
    c = result.counts
    broken = []
    if max_compiles is not None and c.compiles > max_compiles:
        broken.append(f"{c.compiles} compiles (limit {max_compiles})")
    if max_transfers_from_device is not None and c.transfers_from_device > max_transfers_from_device:
        broken.append(f"{c.transfers_from_device} device-to-host transfers "
                      f"(limit {max_transfers_from_device})")
    if max_fallback_ops is not None and c.fallback_ops > max_fallback_ops:
        broken.append(f"{c.fallback_ops} CPU-fallback ops (limit {max_fallback_ops})")
    if broken:
        raise LimitExceeded(f"{what}: " + "; ".join(broken) + f". All counts: {c.as_dict()}")
