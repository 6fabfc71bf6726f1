"""Loader experiments for ``notebooks/02_parallel_loader.ipynb`` (course only): the naive loop,
the device loader and the on-device ceiling timed side by side (``benchmarks/bench_loader.py``
too), the several-device ParallelLoader and the SPMD input-sharding demos.

The training step they all run, :func:`train_on_batch`, is written in the notebook's cell
marked ``#@save course/loader_experiments.py``; ``tests/test_cells_match_toolkit.py`` keeps
the two equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch.utils.data import DataLoader

from course.datasets import load_digits
from course.models import DigitsCNN
from course.setup import quiet_jax_notice
from tpu_helpers.data import ArrayDataset
from tpu_helpers.device_loader import StrictDeviceLoader
from tpu_helpers.metrics import snapshot, track
from tpu_helpers.spmd import device_mesh

quiet_jax_notice()  # its fresh processes (the 4-device demos) do not run setup_notebook

#: A training step on one batch, ``step(x, y) -> loss`` (the loops below time it).
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LoopTiming:
    """One timed loop: steps, wall seconds, and what XLA did meanwhile."""
    name: str
    steps: int
    seconds: float
    compiles: int
    executions: int
    transfers_to_device: int
    #: steps/s of every round when :func:`compare_loops` ran several (this one is the best)
    round_rates: tuple[float, ...] = ()
    #: host seconds the training loop spent outside the step: getting (and, in the naive
    #: loop, copying) the next batch and ``torch_xla.sync()``; NaN when not measured
    outside_step_seconds: float = float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["steps_per_s"] = self.steps_per_s
        row["transfers_per_step"] = self.transfers_to_device / max(self.steps, 1)
        row["executions_per_step"] = self.executions / max(self.steps, 1)
        row["ms_outside_step_per_step"] = 1e3 * self.outside_step_seconds / max(self.steps, 1)
        rates = list(self.round_rates) or [self.steps_per_s]
        row["round_rates"] = rates
        row["min_steps_per_s"], row["max_steps_per_s"] = min(rates), max(rates)
        row["median_steps_per_s"] = float(sorted(rates)[len(rates) // 2])
        return row


class StepClock:
    """``step`` that adds up the host seconds spent in its calls (tracing the step)."""

    def __init__(self, step: Step) -> None:
        self.step, self.seconds = step, 0.0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self.step(x, y)
        finally:
            self.seconds += time.perf_counter() - start


def time_loop(name: str, run: Callable[[], int], clock: StepClock | None = None) -> LoopTiming:
    """Run ``run()`` (which returns its step count) and time it, device work included.

    With the ``clock`` that wraps the loop's step, also the host time the loop spent outside
    the step (from the loop's start until it returns, minus the time in the step's calls)."""
    xm.wait_device_ops()
    before, start = snapshot(), time.perf_counter()
    in_step = clock.seconds if clock else 0.0
    steps = run()
    loop_seconds = time.perf_counter() - start
    xm.wait_device_ops()  # count the time the device needs, not just the tracing
    seconds = time.perf_counter() - start
    c = snapshot() - before
    outside = loop_seconds - (clock.seconds - in_step) if clock else float("nan")
    return LoopTiming(name, steps, seconds, c.compiles, c.executions, c.transfers_to_device,
                      outside_step_seconds=outside)


def naive_loop(loader: Iterable, step: Step, device: Any, max_steps: int | None = None) -> int:
    """What most first TPU loops look like: copy each batch, step, sync. Returns steps."""
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
        step(x, y)  # no sync here: the loader calls torch_xla.sync() before each batch
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    torch_xla.sync()  # after a `break` the last step is still unsynced: run it now
    return steps


def on_device_loop(batches: list[tuple[torch.Tensor, ...]], step: Step) -> int:
    """The ceiling: the same step on batches already on the device. Returns steps."""
    for x, y, *_ in batches:
        step(x, y)
        torch_xla.sync()
    return len(batches)


def train_on_batch(model, optimizer, x, y):
    """One training step on a batch already on the device; returns the loss (on the device)."""
    optimizer.zero_grad(set_to_none=False)  # keep the gradient tensors: one graph every step
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    xm.optimizer_step(optimizer)  # all-reduce the gradients over the replicas, then step
    return loss


def sgd_step(model: torch.nn.Module, lr: float = 0.05) -> Step:
    """``step(x, y)``: :func:`train_on_batch` on ``model`` with a new SGD optimizer."""
    return partial(train_on_batch, model, torch.optim.SGD(model.parameters(), lr=lr))


def warm_up(step: Step, batch: tuple[torch.Tensor, ...], device: Any, max_steps: int = 4) -> int:
    """Run ``step`` on one batch until a step compiles nothing; return the steps it took.

    A training step usually compiles twice: the first step has no gradients yet (the graph
    creates them), every later step updates existing ones.
    """
    x, y = batch[0].to(device), batch[1].to(device)
    for n in range(1, max_steps + 1):
        before = snapshot().compiles
        step(x, y)
        torch_xla.sync()
        if snapshot().compiles == before:
            return n
    raise RuntimeError(f"the step still compiles after {max_steps} identical steps: its graph "
                       "changes every step (see notebook 05 for finding out why).")


def compare_loops(loader: Iterable, step: Step, device: Any, steps: int,
                  rounds: int = 1, **loader_kwargs: Any) -> list[LoopTiming]:
    """Time ``naive``, ``MpDeviceLoader`` and ``on-device`` loops of ``steps`` steps each.

    The step is compiled first (:func:`warm_up`), so the timed loops should show zero
    compiles. With ``rounds > 1`` the three loops take turns (the order rotating each
    round) and each keeps its fastest round: other work on a shared machine then slows
    all three alike instead of whichever happened to run during a burst.
    """
    warm_up(step, next(iter(loader)), device)
    clock = StepClock(step)
    resident = []
    for batch in loader:
        resident.append(tuple(t.to(device) for t in batch[:2]))
        if len(resident) >= steps:
            break
    loops: list[tuple[str, Callable[[], int]]] = [
        ("naive .to(device)", lambda: naive_loop(loader, clock, device, steps)),
        ("MpDeviceLoader", lambda: device_loader_loop(loader, clock, device, steps,
                                                      **loader_kwargs)),
        ("on device (ceiling)", lambda: on_device_loop(resident, clock)),
    ]
    best: dict[str, LoopTiming] = {}
    rates: dict[str, list[float]] = {name: [] for name, _ in loops}
    for r in range(rounds):
        for name, run in loops[r % 3:] + loops[:r % 3]:
            t = time_loop(name, run, clock)
            rates[name].append(t.steps_per_s)
            if name not in best or t.steps_per_s > best[name].steps_per_s:
                best[name] = t
    return [replace(best[name], round_rates=tuple(rates[name])) for name, _ in loops]


def spmd_loader_demo(batch_size: int = 64, steps: int = 5) -> dict[str, Any]:
    """In THIS process: switch to SPMD and load the digits through ``MpDeviceLoader`` with
    ``input_sharding`` split over every device; train ``steps`` SGD steps on them.

    Returns the device count, ``xr.world_size()``, each device's shard of the first batch
    (``tensor``, ``device``, ``shape``, ``rows``), and the compiles of the first two steps
    and of the ``steps - 2`` later ones (``steps >= 3``). Call it in a fresh process
    (:func:`run_spmd_loader_demo` does): SPMD must be switched on before anything else
    touches the XLA device.
    """
    if steps < 3:
        raise ValueError(f"steps must be >= 3 (two warm-up steps and later ones), got {steps}")
    xr.use_spmd()  # first, before any tensor touches the device
    mesh = device_mesh(("data",))
    images, labels = load_digits("train")
    loader = pl.MpDeviceLoader(
        DataLoader(ArrayDataset(images, labels, 10), batch_size=batch_size, shuffle=True,
                   drop_last=True),                               # the GLOBAL batch
        torch_xla.device(),
        input_sharding=xs.ShardingSpec(mesh, ("data", None, None, None)),
    )
    torch.manual_seed(0)
    step = sgd_step(DigitsCNN().to(torch_xla.device()))
    batches = iter(loader)
    x, y = next(batches)
    shards = [{"tensor": name, "global shape": list(t.shape), "device": s.shard_device,
               "shape": list(s.data.shape),
               "rows": "all" if s.indices == Ellipsis else
               f"{s.indices[0].start}:{s.indices[0].stop}"}
              for name, t in (("x", x), ("y", y))
              for s in xs.XLAShardedTensor(t).local_shards]
    with track() as first:  # steps 1 and 2 compile: step 1 also creates the gradients
        loss = step(x, y)
        torch_xla.sync()
        x, y = next(batches)
        loss = step(x, y)
        torch_xla.sync()
    with track() as later:
        for _ in range(steps - 2):
            x, y = next(batches)
            loss = step(x, y)
    return {"devices": xr.global_runtime_device_count(), "world_size": xr.world_size(),
            "batch_size": batch_size, "shards": shards,
            "compiles_first_two_steps": first.counts.compiles,
            "compiles_later_steps": later.counts.compiles, "later_steps": steps - 2,
            "loss": float(loss.item())}


def parallel_loader_deal_demo(batches: int = 10, batch_size: int = 4) -> dict[str, Any]:
    """In THIS process: ``pl.ParallelLoader(loader, devices)`` over every device this
    process addresses, for a loader of ``batches`` batches whose rows hold their batch
    number. Returns, per device, the batch numbers its ``per_device_loader`` yielded, and
    ``len()`` of one per-device loader. Run it in a fresh process with several devices
    (:func:`run_parallel_loader_deal_demo`)."""
    devices = torch_xla.devices()
    rows = torch.arange(batches * batch_size) // batch_size  # each row: its batch number
    loader = DataLoader(rows, batch_size=batch_size)
    parallel = pl.ParallelLoader(loader, devices)
    got = {str(d): [int(b[0].item()) for b in parallel.per_device_loader(d)] for d in devices}
    return {"devices": len(devices), "batches": len(loader), "per_device": got,
            "len_per_device_loader": len(parallel.per_device_loader(devices[0]))}


def _run_fresh(args: list[str], num_devices: int, timeout: float) -> dict[str, Any]:
    """``python -m course.loader_experiments *args`` on ``num_devices`` virtual XLA:CPU
    devices; its last stdout line, parsed as JSON."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(num_devices),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1")}
    for var in ("TPU_ACCELERATOR_TYPE", "TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "course.loader_experiments", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the demo process failed (exit {proc.returncode}):\n"
                           + proc.stderr[-3000:])
    return json.loads(lines[-1])


def run_parallel_loader_deal_demo(num_devices: int = 4, batches: int = 10,
                                  timeout: float = 300) -> dict[str, Any]:
    """:func:`parallel_loader_deal_demo` in a fresh Python with ``num_devices`` virtual
    XLA:CPU devices (always XLA:CPU: on a TPU machine the kernel holds the chips)."""
    return _run_fresh(["--deal-demo", "--batches", str(batches)], num_devices, timeout)


def run_spmd_loader_demo(batch_size: int = 64, num_devices: int = 4, steps: int = 5,
                         timeout: float = 300) -> dict[str, Any]:
    """Run :func:`spmd_loader_demo` in a fresh Python on ``num_devices`` virtual XLA:CPU
    devices and return its result.

    A fresh process because a process's device count and SPMD mode are fixed at its first
    XLA use (a notebook kernel has usually used its device already). It always runs on
    XLA:CPU, also on a TPU machine, where the kernel holds the chips: the shard shapes are
    the same on a TPU. Raises RuntimeError with the child's stderr if it fails.
    """
    return _run_fresh(["--spmd-demo", "--batch-size", str(batch_size), "--steps", str(steps)],
                      num_devices, timeout)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Run a loader demo in this process.")
    ap.add_argument("--spmd-demo", action="store_true")
    ap.add_argument("--deal-demo", action="store_true")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=10)
    args = ap.parse_args()
    if args.deal_demo:
        print(json.dumps(parallel_loader_deal_demo(args.batches)))
    else:
        print(json.dumps(spmd_loader_demo(args.batch_size, args.steps)))
