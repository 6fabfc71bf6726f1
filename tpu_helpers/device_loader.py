"""MpDeviceLoader that never ends an epoch silently: :class:`StrictDeviceLoader`.

Taught in notebook 02; copy this file alone. In torch_xla 2.8/2.9 an exception in the host
DataLoader (ParallelLoader's thread) is only printed and the epoch ENDS EARLY, leaving the other
replicas waiting in a collective. Importing does not touch the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch_xla.distributed.parallel_loader as pl


class _ErrorCatchingLoader:
    """Iterates a host loader; stores (instead of raising) the first exception."""

    def __init__(self, loader: Iterable) -> None:
        self.loader, self.error = loader, None

    def __iter__(self) -> Iterator:
        try:
            yield from self.loader
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer's thread
            self.error = exc


class StrictDeviceLoader:
    """``pl.MpDeviceLoader(loader, device, **kwargs)``; a host error or short epoch raises."""

    def __init__(self, loader: Iterable, device: Any, **kwargs: Any) -> None:
        self.loader, self.device, self.kwargs = loader, device, kwargs

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        source = _ErrorCatchingLoader(self.loader)
        parallel = pl.ParallelLoader(source, [self.device], **self.kwargs)
        delivered = 0
        try:
            for batch in parallel.per_device_loader(self.device):
                if source.error is not None:
                    break
                delivered += 1
                yield batch
        finally:
            parallel.close()  # also on `break`, so its background threads do not linger
        if source.error is not None:
            raise source.error
        if hasattr(self.loader, "__len__") and delivered != len(self.loader):
            raise RuntimeError(f"the device loader delivered {delivered} of {len(self.loader)} "
                               "batches this epoch, with no error from the host loader.")
