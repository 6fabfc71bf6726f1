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

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class LoopTiming:
    """One timed loop: steps, wall seconds, and what XLA did meanwhile."""

    name: str
    steps: int
    seconds: float
    compiles: int
    executions: int
    transfers_to_device: int

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["steps_per_s"] = self.steps_per_s
        row["transfers_per_step"] = self.transfers_to_device / max(self.steps, 1)
        return row


def time_loop(name: str, run: Callable[[], int]) -> LoopTiming:
    """Run ``run()`` (which returns its step count) and time it, device work included."""
    import torch_xla.core.xla_model as xm

    from tpu_helpers.metrics import snapshot

    xm.wait_device_ops()
    before, start = snapshot(), time.perf_counter()
    steps = run()
    xm.wait_device_ops()  # count the time the device needs, not just the tracing
    seconds = time.perf_counter() - start
    c = snapshot() - before
    return LoopTiming(name, steps, seconds, c.compiles, c.executions, c.transfers_to_device)


def naive_loop(loader: Iterable, step: Step, device: Any, max_steps: int | None = None) -> int:
    """What most first TPU loops look like: copy each batch, step, sync. Returns steps."""
    import torch_xla

    steps = 0
    for x, y, *_ in loader:
        x, y = x.to(device), y.to(device)  # blocks the loop while the batch is copied
        step(x, y)
        torch_xla.sync()
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    return steps


def device_loader_loop(loader: Iterable, step: Step, device: Any,
                       max_steps: int | None = None, **loader_kwargs: Any) -> int:
    """The same step fed by MpDeviceLoader (via :class:`StrictDeviceLoader`). Returns steps."""
    steps = 0
    for x, y, *_ in StrictDeviceLoader(loader, device, **loader_kwargs):
        step(x, y)  # no sync here: the loader calls torch_xla.sync() per batch
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    return steps


def on_device_loop(batches: list[tuple[torch.Tensor, ...]], step: Step) -> int:
    """The ceiling: the same step on batches already on the device. Returns steps."""
    import torch_xla

    for x, y, *_ in batches:
        step(x, y)
        torch_xla.sync()
    return len(batches)


def sgd_step(model: torch.nn.Module, lr: float = 0.05) -> Step:
    """A plain training step (forward, cross-entropy, backward, SGD update) for timing."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)  # keep grad tensors: same graph every step
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def compare_loops(loader: Iterable, step: Step, device: Any, steps: int,
                  rounds: int = 1, **loader_kwargs: Any) -> list[LoopTiming]:
    """Time ``naive``, ``MpDeviceLoader`` and ``on-device`` loops of ``steps`` steps each.

    The step is compiled first (one warm-up batch), so the timed loops should show zero
    compiles. With ``rounds > 1`` the three loops take turns (the order rotating each
    round) and each keeps its fastest round: other work on a shared machine then slows
    all three alike instead of whichever happened to run during a burst.
    """
    import torch_xla

    warm = next(iter(loader))
    step(warm[0].to(device), warm[1].to(device))
    torch_xla.sync()
    resident = []
    for batch in loader:
        resident.append(tuple(t.to(device) for t in batch[:2]))
        if len(resident) >= steps:
            break
    loops: list[tuple[str, Callable[[], int]]] = [
        ("naive .to(device)", lambda: naive_loop(loader, step, device, steps)),
        ("MpDeviceLoader", lambda: device_loader_loop(loader, step, device, steps,
                                                      **loader_kwargs)),
        ("on device (ceiling)", lambda: on_device_loop(resident, step)),
    ]
    best: dict[str, LoopTiming] = {}
    for r in range(rounds):
        for name, run in loops[r % 3:] + loops[:r % 3]:
            t = time_loop(name, run)
            if name not in best or t.steps_per_s > best[name].steps_per_s:
                best[name] = t
    return [best[name] for name, _ in loops]
