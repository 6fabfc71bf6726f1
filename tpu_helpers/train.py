"""Multi-core training the way upstream writes it: one per-replica :func:`fit`, read top to bottom.

Taught in ``notebooks/03_multicore_training.ipynb`` (``#@save`` cells: :func:`train_step`,
:func:`step_seed`, :func:`train_epoch`). Needs ``checkpoint.py`` and ``data.py`` (the loaders:
``make_train_loader``, ``make_eval_loader``). A script for pod workers too::

    python -m tpu_helpers.train --epochs 3           # fake data, like upstream's --fake_data
    python -m tpu_helpers.train --data train.npz --eval-data test.npz --out-dir runs/a [--spmd]

:func:`train` runs :func:`fit` under :func:`launch` (failures name the rank) or SPMD; options
are :class:`Config` (the flags come from it); your pieces (``model_fn()``, ``loss_fn(output,
target)``, ``optimizer_fn(params, config)``, ``scheduler_fn(optimizer, config)``, ``Dataset``s
or numpy arrays, ``loaders_fn``) are keyword arguments of both. ``global_batch`` is one
optimizer step's batch over ALL replicas (each loads ``per_replica_batch(global_batch,
world_size)`` rows: ``data.py``'s loaders take the global batch and split it). A resume
from ``out_dir/checkpoints`` continues bit for bit (weights, optimizer, schedule, data order,
dropout). Text of any length: a ``loaders_fn`` giving dict batches (``buckets.py``'s samplers +
``collate``; not imported here) trains ``model(tokens, mask)`` with ``loss_fn(output, batch)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import itertools
import json
import math
import os
import pickle
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn
from torch.utils.data import Dataset, TensorDataset

try:  # inside the tpu_helpers package
    from . import checkpoint
    from .data import make_eval_loader, make_train_loader
except ImportError:  # copied next to checkpoint.py and data.py into your project
    import checkpoint  # type: ignore[no-redef]

    from data import make_eval_loader, make_train_loader  # type: ignore[no-redef]


def _opt(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class Config:
    """Every option of a run; ``python -m tpu_helpers.train --help`` lists the same fields."""

    epochs: int = _opt(6, "epochs to train")
    global_batch: int = _opt(64, "samples per optimizer step over ALL replicas (each loads "
                             "global_batch // world_size: its per-replica batch)")
    eval_global_batch: int = _opt(64, "evaluation samples per step over ALL replicas (padded "
                                  "+ masked: any data size)")
    lr: float = _opt(3e-3, "learning rate (the built-in optimizers; yours reads config.lr)")
    weight_decay: float = _opt(1e-2, "AdamW weight decay (built-in optimizer)")
    optimizer: str = _opt("adamw", "built-in optimizer, when fit gets no optimizer_fn",
                          choices=("adamw", "sgd"))
    momentum: float = _opt(0.5, "SGD momentum (built-in optimizer)")
    scheduler_step: str = _opt("epoch", "call scheduler.step() after every epoch or step",
                               choices=("epoch", "step"))
    seed: int = _opt(0, "seed of the weights, the shuffle and the dropout")
    log_every: int = _opt(5, "read loss/accuracy back every N steps (in a step closure)")
    max_steps: int | None = _opt(None, "stop after N optimizer steps in total")
    spmd: bool = _opt(False, "one process per host, the batch sharded over all devices")
    data: str = _opt("", ".npz with arrays x, y (default: fake data, like upstream's)")
    eval_data: str = _opt("", ".npz with arrays x, y to evaluate on every epoch")
    out_dir: str | None = _opt(None, "checkpoints/, history.json, final.pt (default: a temp dir)")
    checkpoint_every: int = _opt(0, "also checkpoint every N steps (0: at epoch ends only)")
    keep: int = _opt(2, "step checkpoints to keep")
    storage: str = _opt("shared", "shared: one OUT_DIR, global ordinal 0 writes; local: each "
                        "host's disk, local ordinal 0 writes", choices=("shared", "local"))
    resume: bool = _opt(True, "continue from the newest checkpoint in OUT_DIR/checkpoints")
    resume_new_settings: bool = _opt(False, "resume a checkpoint with other settings: its "
                                     "weights and optimizer, its next epoch (default: refuse)")
    progress: bool = _opt(False, "print 'step k/n' every step and each logged loss")
    compile_cache: str = _opt("", "persistent XLA compile cache folder (default: off); torch_xla "
                              "2.8/2.9 write it but never load it back (pytorch/xla issue 9094), "
                              "so it saves no compile")
    start_method: str = _opt("fork", "how torch_xla.launch starts replicas",
                             choices=("fork", "spawn"))

    def __post_init__(self) -> None:
        for name in ("epochs", "global_batch", "eval_global_batch", "log_every", "keep",
                     "max_steps"):
            if (value := getattr(self, name)) is not None and value < 1:  # max_steps: None ok
                raise ValueError(f"{name} must be >= 1, got {value}")
        for f in dataclasses.fields(self):
            if "choices" in f.metadata and getattr(self, f.name) not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {f.metadata['choices']}, "
                                 f"got {getattr(self, f.name)!r}")


class Net(nn.Module):
    """The script's model: two 3x3 convolutions, a max-pool, dropout, two linear layers."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25),
                                  nn.Linear(2 * width * 16, 64), nn.ReLU(),
                                  nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


Data = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]
#: ``fit``'s data: a training ``Dataset`` of ``(x, y)`` items, or ``(x, y, eval_x, eval_y)``
#: numpy arrays (eval ones may be None), or None (``config.data``, else fake data).
AnyData = Dataset | Data | None


def load_data(config: Config) -> Data:
    """``(x, y, eval_x, eval_y)`` from ``config.data``/``eval_data``, or fake data."""
    if not config.data:  # like upstream's --fake_data: 8x8 images, 10 noisy class patterns
        g = np.random.default_rng(0)
        y = g.integers(0, 10, 2560)
        x = (g.standard_normal((10, 1, 8, 8))[y] + g.standard_normal((2560, 1, 8, 8)))
        return x[:2048].astype(np.float32), y[:2048], x[2048:].astype(np.float32), y[2048:]
    arrays = []
    for path in (config.data, config.eval_data):
        if path:
            with np.load(path, allow_pickle=False) as f:  # arrays only: nothing can run code
                arrays += [f["x"].astype(np.float32), _class_ids(f["y"], path)]
        else:
            arrays += [None, None]
    return tuple(arrays)  # type: ignore[return-value]


def _class_ids(y: np.ndarray, source: str) -> np.ndarray:
    """``y`` as int64 class ids 0..K-1, each present; else a ValueError naming the range."""
    if y.dtype.kind == "f" and np.array_equal(y, np.round(y)):
        y = y.astype(np.int64)
    if y.dtype.kind not in "iu" or y.ndim != 1:
        raise ValueError(f"{source}: y must be 1-D integer class ids, got {y.dtype} {y.shape}")
    present = np.unique(y)
    if len(y) and (present[0] < 0 or len(present) != present[-1] + 1):
        raise ValueError(f"{source}: y holds {len(present)} distinct values in "
                         f"{present[0]}..{present[-1]}, not the class ids 0..K-1 "
                         "(a regression target?)")
    return y.astype(np.int64)


def _datasets(data: AnyData, eval_data: Dataset | None,
              config: Config) -> tuple[Dataset, Dataset | None]:
    """The training and evaluation ``Dataset``s, from datasets or arrays."""
    if data is None or isinstance(data, tuple):
        x, y, ex, ey = load_data(config) if data is None else data
        data = TensorDataset(torch.from_numpy(np.asarray(x, np.float32)),
                             torch.from_numpy(np.asarray(y, np.int64)))
        if ex is not None and eval_data is None:
            eval_data = TensorDataset(torch.from_numpy(np.asarray(ex, np.float32)),
                                      torch.from_numpy(np.asarray(ey, np.int64)))
    return data, eval_data


def make_loaders(train_set, eval_set, config, world, rank):
    """``data.py``'s loaders for this replica, both from GLOBAL batches: the training shard
    (``make_train_loader``) and the evaluation shard padded with masked rows, each row once
    (``make_eval_loader``; batches ``(x, y, index, mask)``)."""
    train = make_train_loader(train_set, config.global_batch, world_size=world, rank=rank,
                              seed=config.seed)
    if eval_set is None:
        return train, None
    return train, make_eval_loader(eval_set, config.eval_global_batch, world_size=world,
                                   rank=rank)


class TrainingDiverged(FloatingPointError):
    """The training loss became NaN or infinite (the error names the step and the lr)."""


def train_step(model, optimizer, x, y, loss_fn=F.cross_entropy):
    """One step; returns ``[loss_sum, correct, count]`` summed over replicas, on the device."""
    optimizer.zero_grad(set_to_none=True)
    output = model(x)
    loss = loss_fn(output, y)
    loss.backward()
    xm.optimizer_step(optimizer)  # all-reduce the gradients across replicas, then step
    n = y.shape[0]
    stats = torch.stack([loss.detach() * n, (output.argmax(1) == y).sum().to(loss.dtype),
                         torch.ones_like(loss) * n])
    return xm.all_reduce(xm.REDUCE_SUM, stats)  # inside the step's graph: no extra compile


def step_seed(seed, step, rank=0):
    """Device RNG seed of ``step`` on ``rank``: a resumed run draws the same dropout masks."""
    return ((seed % 2**23) * 2**28 + step % 2**28) * 2**12 + rank % 2**12


def dict_stats(model: nn.Module, batch: dict[str, torch.Tensor],
               loss_fn: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A dict batch's ``loss`` and ``[loss_sum, correct, count]``: ``loss_fn(model(tokens,
    mask), batch)`` returns the mean loss (count: real rows, index >= 0) or ``(loss, correct,
    count)``; padding rows (index -1, mask False) must add nothing to the loss."""
    out = loss_fn(model(batch["tokens"], batch["mask"]), batch)
    rows = (batch["index"] >= 0).sum()
    loss, correct, count = out if isinstance(out, tuple) else (out, torch.zeros_like(out), rows)
    count = torch.as_tensor(count).to(loss.dtype)
    return loss, torch.stack([loss.detach() * count, torch.as_tensor(correct).to(loss), count])


def dict_step(model, optimizer, batch, loss_fn):
    """:func:`train_step` for a dict batch (no tensor but the totals outlives it: the step
    ending an epoch then has the graph of the others)."""
    optimizer.zero_grad(set_to_none=True)
    loss, stats = dict_stats(model, batch, loss_fn)
    loss.backward()
    xm.optimizer_step(optimizer)
    return xm.all_reduce(xm.REDUCE_SUM, stats)


def dict_epoch(model, optimizer, batches, step, after_step, seed=0, rank=0,
               loss_fn=F.cross_entropy, totals=None):
    """:func:`train_epoch` over dict batches (length buckets), with :func:`dict_stats`."""
    totals = (torch.zeros(3) if totals is None else totals).to(torch_xla.device())
    for batch in batches:
        step += 1
        xm.set_rng_state(step_seed(seed, step, rank))
        totals = totals + dict_step(model, optimizer, batch, loss_fn)
        if after_step(step, totals):
            break
    return totals


def train_epoch(model, optimizer, batches, step, after_step, seed=0, rank=0,
                loss_fn=F.cross_entropy, totals=None):
    """One pass; ``after_step(step, totals)`` logs, checkpoints, True stops; returns totals."""
    totals = (torch.zeros(3) if totals is None else totals).to(torch_xla.device())
    for x, y in batches:
        step += 1
        xm.set_rng_state(step_seed(seed, step, rank))  # dropout: the same masks on a resume
        totals = totals + train_step(model, optimizer, x, y, loss_fn)
        if after_step(step, totals):
            break
    return totals


def evaluate(model, batches, loss_fn=F.cross_entropy):
    """``[loss_sum, correct, count]`` of real (mask True) rows over replicas; per-row losses
    from ``loss_fn(output, target, reduction="none")``. Batches ``(x, y, index, mask)`` (as
    ``make_eval_loader`` gives them) or ``(x, y, mask)``."""
    model.eval()
    totals = torch.zeros(3).to(torch_xla.device())
    with torch.no_grad():
        for batch in batches:
            if isinstance(batch, dict):  # length buckets
                totals = totals + xm.all_reduce(xm.REDUCE_SUM, dict_stats(model, batch,
                                                                          loss_fn)[1])
                continue
            x, y, *_, mask = batch  # (x, y, index, mask) or (x, y, mask)
            output, m = model(x), mask.float()
            loss = loss_fn(output, y, reduction="none")
            stats = torch.stack([(loss * m).sum(), ((output.argmax(1) == y) & mask).sum().float(),
                                 m.sum()])
            totals = totals + xm.all_reduce(xm.REDUCE_SUM, stats)
    model.train()
    return totals


def builtin_optimizer(params: Any, config: Config) -> torch.optim.Optimizer:
    """The built-in optimizer ``config.optimizer`` (``fit``'s default ``optimizer_fn``)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def fit(config: Config, data: AnyData = None, model_fn: Callable[[], nn.Module] = Net, *,
        eval_data: Dataset | None = None,
        loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
        optimizer_fn: Callable[[Any, Config], torch.optim.Optimizer] = builtin_optimizer,
        scheduler_fn: Callable[[Any, Config], Any] | None = None,
        loaders_fn: Callable[..., tuple[Any, Any]] = make_loaders) -> dict[str, Any]:
    """Train in THIS replica (call it in ``torch_xla.launch``'s function, or once under
    SPMD); returns the history. Checkpoints go to ``config.out_dir`` if it is set.
    ``loaders_fn(train_set, eval_set, config, world, rank)`` gives (train, eval) loaders."""
    device = torch_xla.device()
    world, rank, devices = _layout(config)
    _enable_cache(config.compile_cache, rank)
    train_set, eval_set = _datasets(data, eval_data, config)
    train_loader, eval_loader = loaders_fn(train_set, eval_set, config, world, rank)
    epoch_fn = dict_epoch if isinstance(next(iter(train_loader), None), dict) else train_epoch
    if config.spmd and epoch_fn is dict_epoch:
        raise ValueError("dict (length-bucket) batches are not supported with spmd=True yet")
    torch.manual_seed(config.seed)
    model = model_fn().to(device)
    if world > 1:  # v2/v3 run replicas as threads sharing one RNG: start from rank 0's weights
        xm.broadcast_master_param(model)
    optimizer = optimizer_fn(model.parameters(), config)
    scheduler = scheduler_fn(optimizer, config) if scheduler_fn else None
    sharding = _batch_sharding(config, devices, train_set)
    run = start(config, _settings(config, world, devices, len(train_loader), len(train_set)),
                model, optimizer, scheduler)
    while run.epoch < config.epochs and run.step < run.last:
        sampler = getattr(train_loader.batch_sampler, "set_epoch", None) and \
            train_loader.batch_sampler  # a length-bucket batch_sampler, else DistributedSampler
        (sampler or train_loader.sampler).set_epoch(run.epoch)
        loader = pl.MpDeviceLoader(itertools.islice(train_loader, run.batch, None), device,
                                   input_sharding=sharding)
        started, compiles = time.perf_counter(), _compiles()
        totals = epoch_fn(model, optimizer, loader, run.step,
                             functools.partial(run.after_step, model, optimizer),
                             config.seed, rank, loss_fn, run.totals)
        torch_xla.sync()
        if run.batch < len(train_loader):
            break  # stopped by max_steps inside the epoch (after_step checkpointed it)
        seconds = time.perf_counter() - started
        held_out = None if eval_loader is None else evaluate(
            model, pl.MpDeviceLoader(eval_loader, device, input_sharding=sharding), loss_fn)
        run.end_epoch(model, optimizer, totals, held_out, seconds, _compiles() - compiles)
    return run.finish(model)


def _batch_sharding(config: Config, devices: int, train_set: Dataset) -> Any:
    """The SPMD delta: shard the batch axis over a 1-D mesh of devices (None: replicas)."""
    if not config.spmd:
        return None
    mesh = xs.Mesh(np.arange(devices), (devices,), ("data",))
    ndim = torch.as_tensor(train_set[0][0]).ndim + 1  # the batch axis, then a sample's
    return xs.ShardingSpec(mesh, ("data",) + (None,) * (ndim - 1))


def _layout(config: Config) -> tuple[int, int, int]:
    """(world_size, rank, devices) of this replica, after checking the batches split."""
    if config.spmd != xr.is_spmd():
        raise RuntimeError("config.spmd=True needs xr.use_spmd() first" if config.spmd else
                           "this process is in SPMD mode: pass config.spmd=True")
    world, rank, devices = ((1, 0, xr.global_runtime_device_count()) if config.spmd else
                            (xr.world_size(), xr.global_ordinal(), xr.world_size()))
    for name in ("global_batch", "eval_global_batch"):
        if getattr(config, name) % devices:
            raise ValueError(f"{name}={getattr(config, name)} does not split evenly over "
                             f"{devices} devices; use a multiple of {devices}")
    return world, rank, devices


def _compiles() -> int:
    return int((met.metric_data("CompileTime") or (0,))[0])


def _enable_cache(folder: str, rank: int) -> None:
    """``xr.initialize_cache`` per replica, as upstream's test does; a problem only warns."""
    if not folder:
        return
    try:
        xr.initialize_cache(str(Path(folder) / f"replica-{rank}"), readonly=False)
    except Exception as exc:  # an optimisation, never a reason to stop
        warnings.warn(f"compile cache not enabled ({exc})", RuntimeWarning, stacklevel=2)


def _settings(config: Config, world: int, devices: int, steps_per_epoch: int,
              train_samples: int) -> dict[str, Any]:
    """What a checkpoint's step counter means: the batch each step reads depends on these."""
    return {"mode": "spmd" if config.spmd else "launch", "world_size": world,
            "devices": devices, "global_batch": config.global_batch, "seed": config.seed,
            "train_samples": train_samples, "steps_per_epoch": steps_per_epoch}


class ResumeMismatch(checkpoint.CheckpointError):
    """The newest checkpoint was written with other run settings than this run's."""


@dataclass
class Run:
    """Where this replica is (what a checkpoint stores) and the history it reports."""

    config: Config
    settings: dict[str, Any]
    history: dict[str, Any]
    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` done
    step: int = 0
    totals: torch.Tensor = field(default_factory=lambda: torch.zeros(3))
    ckpts: checkpoint.CheckpointDir | None = None
    scheduler: Any = None  # the user's LR scheduler (its state is checkpointed), or None
    from_step: int = 0
    master: bool = field(default_factory=lambda: xm.is_master_ordinal(local=False))

    @property
    def last(self) -> int:
        """The step this run stops at (the same formula fresh, resumed or re-set)."""
        left = self.step - self.batch + (self.config.epochs - self.epoch) * \
            self.settings["steps_per_epoch"]
        return min(left, self.config.max_steps or left)

    def after_step(self, model: nn.Module, optimizer: Any, step: int,
                   totals: torch.Tensor) -> bool:
        """:func:`train_epoch`'s after_step: log, checkpoint, schedule; True: the last step."""
        self.step, self.batch, c = step, self.batch + 1, self.config
        if self.batch % c.log_every == 0:  # read after the step ran: no sync here
            xm.add_step_closure(self._log, args=(self.step, totals, _lr(optimizer)))
        if c.progress and self.master:
            print(f"step {self.step}/{self.last}", flush=True)
        if self.scheduler is not None and c.scheduler_step == "step":
            self.scheduler.step()
        every = c.checkpoint_every and self.step % c.checkpoint_every == 0
        if (every or self.step == self.last) and self.batch < self.settings["steps_per_epoch"]:
            self.save(model, optimizer, totals)  # mid-epoch (epoch ends save in end_epoch)
        return self.step == self.last

    def _log(self, step: int, totals: torch.Tensor, lr: float) -> None:
        loss_sum, correct, count = totals.tolist()  # the loop's one device-to-host read
        _check_finite(loss_sum / count, step, lr)
        self.history["log"].append({"step": step, "loss": loss_sum / count,
                                    "acc": correct / count})
        if self.config.progress and self.master:
            print(f"[step {step}] loss {loss_sum / count:.4f} acc {correct / count:.3f}")

    def save(self, model: nn.Module, optimizer: Any, totals: torch.Tensor,
             best: bool = False) -> None:
        """Checkpoint on every replica (capture syncs first: logging closures have run)."""
        if self.ckpts is None:
            return
        extra = {"history": self.history, "settings": self.settings, "totals": totals}
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.state_dict()
        state = checkpoint.capture_training_state(
            model, optimizer, epoch=self.epoch, batch_in_epoch=self.batch, step=self.step,
            extra=extra)
        self.ckpts.save(state, self.step)
        if best:
            self.ckpts.save_best(state)

    def end_epoch(self, model: nn.Module, optimizer: Any, totals: torch.Tensor,
                  eval_totals: torch.Tensor | None, seconds: float, compiles: int) -> None:
        tr = totals.tolist()  # end of epoch: the two small reads
        _check_finite(tr[0] / tr[2], self.step, _lr(optimizer))
        ev = eval_totals.tolist() if eval_totals is not None else [float("nan"), 0.0, 1.0]
        h = self.history
        row = {"epoch": self.epoch + 1, "steps": self.settings["steps_per_epoch"],
               "step": self.step, "lr": _lr(optimizer), "train_loss": tr[0] / tr[2],
               "train_acc": tr[1] / tr[2], "eval_loss": ev[0] / ev[2],
               "eval_acc": ev[1] / ev[2], "eval_count": int(ev[2]),
               "train_seconds": round(seconds, 3), "compiles": compiles}
        h["epochs"].append(row)
        best = h["best_eval_acc"] is None or row["eval_acc"] > h["best_eval_acc"]
        if best:  # from the reduced metric: the same decision on every replica
            h["best_eval_acc"], h["best_epoch"] = row["eval_acc"], self.epoch + 1
        if self.scheduler is not None and self.config.scheduler_step == "epoch":
            self.scheduler.step()  # before the checkpoint: a resume starts the next epoch
        self.epoch, self.batch, self.totals = self.epoch + 1, 0, torch.zeros(3)
        self.save(model, optimizer, torch.zeros(3), best=best)

    def finish(self, model: nn.Module) -> dict[str, Any]:
        self.history["total_steps"] = self.step
        self.history["runs"][-1]["steps"] = self.step - self.from_step
        self.history["compile_cache"] = {n: int(met.counter_value(n) or 0) for n in
                                         met.counter_names() if n.startswith("PersistentCache")}
        if self.step == self.from_step:  # e.g. train() called again with the same out_dir
            self.history["note"] = (
                f"0 steps run: resumed at step {self.step}, where epochs={self.config.epochs}"
                f", max_steps={self.config.max_steps} stop; raise them, or start over "
                "(resume=False / --no-resume, or another out_dir)")
            if self.master:
                print(self.history["note"], flush=True)
        if self.config.out_dir:
            out = Path(self.config.out_dir)
            written = checkpoint.save_checkpoint(out / "final.pt", {"model": model.state_dict(),
                                      "step": self.step}, storage=self.config.storage)
            if written is not None:  # this replica is the writer
                save_history(out / "history.json", self.history)
        return self.history


def _lr(optimizer: Any) -> float:
    """The learning rate of the first parameter group, as a float (host value: no sync)."""
    return float(optimizer.param_groups[0]["lr"])


def _check_finite(loss: float, step: int, lr: float) -> None:
    if not math.isfinite(loss):
        raise TrainingDiverged(f"the training loss is {loss} at step {step} (learning rate "
                               f"{lr:g}): lower the learning rate or check the data")


def start(config: Config, settings: dict[str, Any], model: nn.Module, optimizer: Any,
          scheduler: Any = None) -> Run:
    """A fresh :class:`Run`, or the one the newest checkpoint in ``out_dir`` continues."""
    history = {**settings, "epochs": [], "log": [], "best_eval_acc": None, "best_epoch": None,
               "resumed_from": [], "config": dataclasses.asdict(config),
               "runs": [{"from_step": 0, "checkpoint": None, "settings": settings}]}
    ckpts = (checkpoint.CheckpointDir(Path(config.out_dir) / "checkpoints", keep=config.keep,
                           storage=config.storage) if config.out_dir else None)
    ckpt, path = ckpts.load_latest() if ckpts and config.resume else (None, None)
    if ckpt is None:
        return Run(config, settings, history, ckpts=ckpts, scheduler=scheduler)
    run = resume_from(ckpt, path, config, settings, model, optimizer, scheduler)
    run.ckpts = ckpts
    return run


def resume_from(ckpt: dict[str, Any], path: Path, config: Config, settings: dict[str, Any],
                model: nn.Module, optimizer: Any, scheduler: Any = None) -> Run:
    """Restore ``ckpt``; other settings raise :class:`ResumeMismatch` unless
    ``config.resume_new_settings`` (then: its weights and optimizer, its next epoch)."""
    saved = ckpt.get("extra", {}).get("settings")
    changes = ([f"{k}={saved.get(k)!r} in the checkpoint, {v!r} now"
                for k, v in settings.items() if saved.get(k) != v]
               if isinstance(saved, dict) else ["no run settings stored"])
    if (scheduler is None) != ("scheduler" not in ckpt.get("extra", {})):
        changes.append(f"scheduler {'not ' * (scheduler is None)}given now, "
                       f"{'none ' * (scheduler is not None)}in the checkpoint")
    if changes and not config.resume_new_settings:
        raise ResumeMismatch(
            f"{path}: written with other run settings ({'; '.join(changes)}): start over "
            "(--no-resume or another --out-dir) or keep its weights and optimizer and start "
            "a new epoch (--resume-new-settings, Config(resume_new_settings=True)).")
    where = checkpoint.restore_training_state(ckpt, model, optimizer, source=str(path))
    if scheduler is not None and "scheduler" in where.extra:
        scheduler.load_state_dict(where.extra["scheduler"])
    history = where.extra["history"]
    history["resumed_from"].append(path.name)
    history["config"] = dataclasses.asdict(config)
    history["runs"].append({"from_step": where.step, "checkpoint": path.name,
                            "settings": settings, "new_settings": bool(changes)})
    history.update(settings)
    run = Run(config, settings, history, where.epoch, where.batch_in_epoch, where.step,
              where.extra["totals"], scheduler=scheduler, from_step=where.step)
    if changes and run.batch:  # new settings: a new epoch (its batches meant other rows)
        run.epoch, run.batch, run.totals = run.epoch + 1, 0, torch.zeros(3)
    return run


def save_history(path: str | os.PathLike[str], history: dict[str, Any]) -> Path:
    """Write ``history`` as JSON with ``checkpoint.atomic_write``."""
    return checkpoint.atomic_write(path, lambda f: f.write(json.dumps(history, indent=1).encode()))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


class ReplicaFailed(RuntimeError):
    """A replica of ``torch_xla.launch`` failed: which rank, what, and its traceback."""

    def __init__(self, rank: int | None, summary: str, details: str = "") -> None:
        self.rank, self.summary, self.details = rank, summary, details
        who = "a replica" if rank is None else f"rank {rank}"
        super().__init__(f"{who} failed: {summary}" + (f"\n\n{details}" if details else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across the process pool
        return (ReplicaFailed, (self.rank, self.summary, self.details))


class _Reported:
    """Per-replica wrapper: files say which rank started, failed or finished; each process
    dumps its Python stack on a crash (``rank-R.pid-P.crash``, R its first replica) and on
    SIGTERM (``.sigterm``: the pool stops the other workers with SIGTERM when one dies)."""

    _dumps: dict[int, tuple[Any, Any]] = {}  # per process (v2/v3: 2 replicas as threads)
    _lock = threading.Lock()

    def __init__(self, fn: Callable[..., Any], report_dir: str) -> None:
        self.fn, self.report_dir = fn, report_dir

    def _watch(self, folder: Path, rank: int) -> None:
        """Dump files first, then the marker: a rank that says it started can be judged."""
        with self._lock:
            if os.getpid() in self._dumps:
                return
            name = f"rank-{rank}.pid-{os.getpid()}"  # files open as long as the process:
            crash, term = (open(folder / f"{name}.{kind}", "w")  # noqa: SIM115
                           for kind in ("crash", "sigterm"))
            self._dumps[os.getpid()] = (crash, term)
            faulthandler.enable(file=crash, all_threads=True)
            # C-level handler: runs even while native code holds the GIL; chain=True then
            # lets SIGTERM end the process as before.
            faulthandler.register(signal.SIGTERM, file=term, all_threads=True, chain=True)

    def __call__(self, rank: int, *args: Any) -> Any:
        folder = Path(self.report_dir)
        self._watch(folder, rank)
        local = {"rank": rank, "pid": os.getpid(), "thread": threading.get_ident(),
                 "local": int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0")),
                 "count": int(os.environ.get("PJRT_LOCAL_PROCESS_COUNT", "1"))}
        checkpoint.atomic_write(folder / f"rank-{rank}.started",
                                lambda f: f.write(json.dumps(local).encode()))
        try:
            result = self.fn(rank, *args)
        except BaseException as exc:
            details = traceback.format_exc()
            checkpoint.atomic_write(folder / f"rank-{rank}.error",
                                    lambda f: f.write(details.encode()))
            raise ReplicaFailed(rank, f"{type(exc).__name__}: {exc}", details) from None
        (folder / f"rank-{rank}.done").touch()
        return result


def _blame(folder: Path) -> ReplicaFailed:
    """Which replica broke the pool (the pool then SIGTERMs the others): the process with a
    crash dump; else the one that died without the pool's SIGTERM (SIGKILL, the out-of-memory
    killer, os._exit); else the local process that never started its replica."""
    procs: dict[int, dict[str, Any]] = {}
    for path in folder.glob("rank-*.started"):
        info = json.loads(path.read_text())
        proc = procs.setdefault(info["pid"], {**info, "ranks": [], "infos": []})
        proc["ranks"].append(info["rank"])
        proc["infos"].append(info)
    ended = {int(p.name.split(".")[0][len("rank-"):]) for p in
             itertools.chain(folder.glob("rank-*.done"), folder.glob("rank-*.error"))}

    def dump(pid: int, kind: str) -> str:
        return "".join(p.read_text() for p in folder.glob(f"rank-*.pid-{pid}.{kind}")).strip()

    def ranks(pid: int) -> str:
        return ", ".join(map(str, sorted(procs[pid]["ranks"])))

    crashed = sorted((_crashed_rank(p, procs), p.read_text().strip())
                     for p in folder.glob("rank-*.pid-*.crash") if p.stat().st_size)
    if crashed:  # written before the process died: the one sure sign
        also = "".join(f"; rank {rank} crashed too" for rank, _ in crashed[1:])
        return ReplicaFailed(crashed[0][0], "the process died without a Python exception (a "
                             f"crash in native code; the Python stack it dumped is below){also}",
                             crashed[0][1])
    silent = sorted((pid for pid, p in procs.items() if not dump(pid, "sigterm")
                     and not set(p["ranks"]) <= ended), key=lambda pid: procs[pid]["ranks"])
    count = max((p["count"] for p in procs.values()), default=0)
    unstarted = sorted(set(range(count)) - {p["local"] for p in procs.values()})
    if len(silent) == 1 and not unstarted:
        return ReplicaFailed(min(procs[silent[0]]["ranks"]), "the process died without a "
                             "Python exception and without a stack dump (SIGKILL, e.g. from "
                             "the out-of-memory killer, or os._exit); the pool then stopped "
                             "the other replicas with SIGTERM",
                             "(no Python stack was dumped: SIGKILL or os._exit)")
    if len(unstarted) == 1 and not silent:
        return ReplicaFailed(None, f"local process {unstarted[0]} of {count} died before "
                             "its replica started (its rank was not known yet)")
    return ReplicaFailed(None, "the process pool broke and the files do not say which "
                         "replica died first: no crash dump; died without the pool's "
                         f"SIGTERM: rank(s) {'; '.join(map(ranks, silent)) or 'none'}; "
                         f"never started: local process(es) {unstarted or 'none'}")


def _crashed_rank(dump: Path, procs: dict[int, dict[str, Any]]) -> int:
    """The rank whose thread crashed (v2/v3 run 2 replicas as threads of one process):
    faulthandler names the "Current thread"; else the process's first replica."""
    rank, pid = (int(part.split("-")[1]) for part in dump.name.split(".")[:2])
    current = re.search(r"Current thread (0x[0-9a-f]+)", dump.read_text())
    threads = {info["thread"]: info["rank"] for info in procs.get(pid, {}).get("infos", [])}
    return threads.get(int(current.group(1), 16), rank) if current else rank


class _Probe(pickle.Pickler):
    """Pickles into nothing; arrays and tensors are skipped (they pickle, and can be big)."""

    def __init__(self) -> None:
        super().__init__(self, protocol=pickle.HIGHEST_PROTOCOL)

    def write(self, data: bytes) -> int:  # the pickler's own output file
        return len(data)

    def persistent_id(self, obj: Any) -> int | None:
        return 0 if isinstance(obj, np.ndarray | torch.Tensor) else None


def _pickle_error(obj: Any) -> Exception | None:
    """What pickling ``obj`` raises, or None."""
    try:
        _Probe().dump(obj)
    except Exception as exc:  # PicklingError, AttributeError, TypeError: all mean "cannot"
        return exc
    return None


def _unpicklable(obj: Any, where: str, depth: int = 0) -> tuple[str, Any, Exception] | None:
    """The innermost part of ``obj`` that cannot be pickled: (its path, it, the error)."""
    error = _pickle_error(obj)
    if error is None:
        return None
    parts: Any = ()
    if isinstance(obj, functools.partial):
        parts = [(f"{where}.func", obj.func), (f"{where}.args", obj.args)]
    elif isinstance(obj, list | tuple):
        parts = ((f"{where}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, dict):
        parts = ((f"{where}[{k!r}]", v) for k, v in obj.items())
    elif not callable(obj) and hasattr(obj, "__dict__"):
        parts = ((f"{where}.{k}", v) for k, v in vars(obj).items())
    for name, part in parts if depth < 6 else ():
        if found := _unpicklable(part, name, depth + 1):
            return found
    return where, obj, error


def check_picklable(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
    """Raise ``TypeError`` naming the part of ``fn``/``args`` that ``torch_xla.launch``
    could not send to its replicas, before any process starts."""
    found = _unpicklable(fn, "fn") or _unpicklable(tuple(args), "args")
    if found is None:
        return
    where, obj, error = found
    raise TypeError(
        f"launch cannot send {where} ({obj!r:.100}) to the replicas: {error}. "
        "torch_xla.launch pickles the function and its args for every replica process, "
        "even with start_method='fork' (fork only spares the replicas re-importing "
        "__main__): define the function at module level (a notebook's top-level cell is "
        "fine with fork; not a lambda, not inside another function) and pass data "
        "through `args`.")


def launch(fn: Callable[..., Any], args: tuple[Any, ...] = (), *,
           start_method: str = "fork") -> None:
    """``torch_xla.launch``; checks first that ``fn`` and ``args`` pickle; a failure, even
    a native crash, raises :class:`ReplicaFailed` naming the rank, with its traceback (or
    the stack faulthandler dumped)."""
    check_picklable(fn, args)
    report_dir = Path(tempfile.mkdtemp(prefix="tpu_helpers-launch-"))
    try:
        torch_xla.launch(_Reported(fn, str(report_dir)), args=args, start_method=start_method)
    except BrokenProcessPool as exc:
        raise _blame(report_dir) from exc
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


def _replica(rank, config, data, model_fn, hooks):
    fit(config, data, model_fn, **hooks)


def train(config: Config, data: AnyData = None, model_fn: Callable[[], nn.Module] = Net,
          **hooks: Any) -> dict[str, Any]:
    """Run :func:`fit` on every replica (or under SPMD); returns the history. ``hooks`` are
    :func:`fit`'s keyword arguments (module-level functions: launch pickles them)."""
    out = Path(config.out_dir or tempfile.mkdtemp(prefix="tpu_helpers-run-"))
    config = dataclasses.replace(config, out_dir=str(out))
    if config.spmd:
        if not xr.is_spmd():
            xr.use_spmd()
        return fit(config, data, model_fn, **hooks)
    launch(_replica, args=(config, data, model_fn, hooks), start_method=config.start_method)
    if not (out / "history.json").is_file():
        raise FileNotFoundError(f"{out / 'history.json'} was not written on this host: with "
                                "storage='shared' OUT_DIR must be a folder every host sees; "
                                "for each host's own disk use storage='local'.")
    history = json.loads((out / "history.json").read_text())
    if "note" in history and history["runs"][-1].get("steps") == 0:
        warnings.warn(history["note"], RuntimeWarning, stacklevel=2)
    return history


def parser() -> argparse.ArgumentParser:
    """The command line, one flag per :class:`Config` field."""
    p = argparse.ArgumentParser(description="Train on every TPU core (or XLA:CPU); resumes "
                                "from OUT_DIR/checkpoints. Run it on every worker of a pod.")
    for f in dataclasses.fields(Config):
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"] + " (%(default)s)"
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=text)
        else:
            kind = {"int": int, "float": float, "int | None": int}.get(f.type, str)
            p.add_argument(flag, type=kind, default=f.default, help=text,
                           choices=f.metadata.get("choices"))
    return p


def main(argv: list[str] | None = None) -> int:
    h = train(Config(**vars(parser().parse_args(argv))))
    done = f"done: {h['total_steps']} steps, world size {h['world_size']} on {h['devices']} "
    if h["epochs"]:
        done += f"device(s), held-out accuracy {h['epochs'][-1]['eval_acc']:.4f}"
    if h["resumed_from"]:
        done += f"; resumed from {', '.join(h['resumed_from'])}"
    print(f"{done}; files in {h['config']['out_dir']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
