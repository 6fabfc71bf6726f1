"""MpDeviceLoader that never ends an epoch silently: :class:`StrictDeviceLoader`.

Taught in ``notebooks/02_parallel_loader.ipynb``. Copy this file alone (torch, torch_xla);
feed it a loader from ``data.py``'s ``make_train_loader`` or your own DataLoader with a
``DistributedSampler``.

Why: in torch_xla 2.8 and 2.9 an exception raised by the host DataLoader (a corrupt
file, a bug in ``__getitem__``) inside ParallelLoader's loader thread is printed from that
thread and the epoch then simply ENDS EARLY: the training loop sees ``StopIteration``,
not the error, and on several replicas the one that stopped early leaves the others
waiting in a collective. This wrapper re-raises the original exception in the training
loop and checks that the epoch delivered ``len(loader)`` batches.

Importing this module does not touch the XLA device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch_xla.distributed.parallel_loader as pl

#: A training step on one batch, ``step(x, y) -> loss`` (course code times loops of it).
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _ErrorCatchingLoader:
    """Iterates a host loader; stores (instead of raising) the first exception."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        self.error = None
        try:
            yield from self.loader
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer's thread
            self.error = exc


class StrictDeviceLoader:
    """``pl.MpDeviceLoader(loader, device, **kwargs)`` that never ends an epoch silently.

    Same behaviour otherwise: background host-to-device transfer, prefetching, one
    ``torch_xla.sync()`` per ``batches_per_execution`` batches, the batches and batch size
    of ``loader`` unchanged (it does not shard: use a ``DistributedSampler``). If the host
    loader raises, the original exception is raised in the loop; if an epoch yields fewer
    than ``len(loader)`` batches without an exception, a RuntimeError says so.
    """

    def __init__(self, loader: Iterable, device: Any, **kwargs: Any) -> None:
        self.loader = loader
        self.device = device
        self.kwargs = kwargs

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        source = _ErrorCatchingLoader(self.loader)
        # What MpDeviceLoader does, with the ParallelLoader closed when the loop stops
        # early (a `break`), so its background threads do not linger.
        parallel = pl.ParallelLoader(source, [self.device], **self.kwargs)
        delivered = 0
        try:
            for batch in parallel.per_device_loader(self.device):
                if source.error is not None:
                    break
                delivered += 1
                yield batch
        finally:
            parallel.close()
        if source.error is not None:
            raise source.error
        expected = len(self.loader) if hasattr(self.loader, "__len__") else None
        if expected is not None and delivered != expected:
            raise RuntimeError(f"the device loader delivered {delivered} of {expected} batches "
                               "this epoch, with no error from the host loader.")
