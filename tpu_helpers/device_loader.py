"""Feeding the device: MpDeviceLoader without silent short epochs, and measuring the feed.

Taught in ``notebooks/02_parallel_loader.ipynb``; ``benchmarks/bench_loader.py`` runs
:func:`compare_loops`.

* :class:`StrictDeviceLoader` is ``pl.MpDeviceLoader`` plus one fix. In torch_xla 2.9 an
  exception raised by the host DataLoader (a corrupt file, a bug in ``__getitem__``)
  inside ParallelLoader's background thread is printed and the epoch then simply ENDS
  EARLY: the training loop sees ``StopIteration``, not the error. On several replicas the
  one that stopped early leaves the others waiting in a collective. This wrapper
  re-raises the original exception in the training loop and checks that the epoch
  delivered ``len(loader)`` batches.
* :func:`naive_loop`, :func:`device_loader_loop`, :func:`on_device_loop` run the same step
  three ways (``.to(device)`` per batch; MpDeviceLoader; batches already on the device)
  and :func:`compare_loops` times them in one process, with compile and transfer counts
  from :mod:`tpu_helpers.metrics`.

Importing this module does not touch the XLA device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

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
        import torch_xla.distributed.parallel_loader as pl

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


# --------------------------------------------------------------------------- timing


# --------------------------------------------------------------------------- SPMD
