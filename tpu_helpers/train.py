"""Multi-core training: one step, one loop, a launch that names the failing rank, a script.

Taught in ``notebooks/03_multicore_training.ipynb``; ``benchmarks/bench_training.py``
times :func:`train_step` / :func:`train_epoch`; ``python -m tpu_helpers.train --help``
runs the same training from a shell, here or on every worker of a TPU pod.

The pieces, from the inside out:

* :func:`train_step`: forward, loss, backward, ``xm.optimizer_step`` (all-reduces the
  gradients across replicas, then steps), and the step's ``[loss_sum, correct, count]``
  all-reduced across replicas, all traced into ONE graph that is the same every step.
  Nothing is read back to the host.
* :func:`train_epoch`: loops over device batches (``MpDeviceLoader`` output), keeps
  running totals on the device and reads them only in a step closure every
  ``log_every`` steps (``xm.add_step_closure``: after the step ran, no extra graph).
* :func:`fit`: the per-replica program (data sharded by ``DistributedSampler``, the
  digits CNN, AdamW, evaluation with padded + masked batches, checkpoints, resume). The
  same code runs under ``torch_xla.launch`` (one process per device) and under SPMD
  (one process, the batch sharded over a device mesh).
* :func:`launch`: ``torch_xla.launch`` whose failures say which rank failed and show its
  original traceback (even for a crash without a Python exception), instead of a bare
  ``BrokenProcessPool``.
* :func:`train`: runs :func:`fit` in the chosen mode and returns a :class:`RunResult`.

Global batch size: ``batch_size`` is the number of samples per optimizer step over all
replicas together; each of ``world_size`` replicas loads ``batch_size // world_size``.
Under SPMD the one loader yields the whole batch and ``input_sharding`` splits it.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tpu_helpers.checkpoint import (
    CheckpointDir,
    CheckpointError,
    atomic_write,
    capture_training_state,
    is_checkpoint_writer,
    restore_training_state,
    rng_state,
    save_checkpoint,
)

PROGRESS_KINDS = ("bar", "lines", "none")


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run (also the script's command-line flags)."""

    epochs: int = 6
    #: Samples per optimizer step over ALL replicas (each loads batch_size // world_size).
    batch_size: int = 64
    #: Evaluation batch over all replicas (padded + masked, so any size works).
    eval_batch_size: int = 72
    lr: float = 3e-3
    weight_decay: float = 1e-2
    seed: int = 0
    #: Read the running loss/accuracy (one device-to-host transfer) every N steps.
    log_every: int = 5
    #: Stop after this many optimizer steps in total (None: run all epochs).
    max_steps: int | None = None
    #: One process, batch sharded over every device (xr.use_spmd()) instead of launch.
    spmd: bool = False
    #: Folder for checkpoints/, history.json and final.pt (train() picks a temp dir if None).
    out_dir: str | None = None
    #: Also checkpoint every N steps (0: only at the end of each epoch).
    checkpoint_every: int = 0
    #: Also checkpoint after exactly these global steps.
    checkpoint_steps: tuple[int, ...] = ()
    #: Keep the newest N step checkpoints (None: keep all).
    keep: int | None = 2
    #: "shared": one writer in the job (global ordinal 0); "local": one per host.
    storage: str = "shared"
    #: Continue from the newest checkpoint in out_dir/checkpoints if there is one.
    resume: bool = True
    #: If that checkpoint was written with other run settings (batch size, device count,
    #: mode, seed, data size), keep its weights and optimizer state and start its next
    #: epoch with the new settings, instead of refusing (:class:`ResumeMismatch`).
    resume_new_settings: bool = False
    #: "bar" (one tqdm bar on the master), "lines" ("step k/n" lines), or "none".
    progress: str = "bar"
    #: Persistent compile cache folder, "auto" (compile_cache_dir() on a TPU, off without
    #: one: XLA:CPU cannot read its cache back) or None (off).
    compile_cache: str | None = None
    #: Data folder (default: the repo's data/ or $TPU_NB_DATA).
    data_root: str | None = None

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {self.max_steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.progress not in PROGRESS_KINDS:
            raise ValueError(f"progress must be one of {PROGRESS_KINDS}, got {self.progress!r}")
        if self.storage not in ("shared", "local"):
            raise ValueError(f"storage must be 'shared' or 'local', got {self.storage!r}")
        object.__setattr__(self, "checkpoint_steps", tuple(int(s) for s in self.checkpoint_steps))


# --------------------------------------------------------------------------- the hot loop


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
    """One optimizer step; returns ``[loss_sum, correct, count]`` summed over replicas.

    Everything stays on the device (no ``.item()``): the result is part of the step's
    graph and is read later, in a step closure, only when it is logged.
    """
    import torch_xla.core.xla_model as xm

    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    xm.optimizer_step(optimizer)  # all-reduce gradients across replicas, then step
    n = y.shape[0]
    stats = torch.stack([loss.detach() * n, (logits.argmax(1) == y).sum().to(loss.dtype),
                         torch.ones_like(loss) * n])
    return xm.all_reduce(xm.REDUCE_SUM, stats)  # a clone with one replica / under SPMD


def step_seed(seed: int, step: int, replica: int = 0) -> int:
    """The device RNG seed for global step ``step`` of replica ``replica`` of a run.

    Replicas get different seeds, so their dropout masks are independent (each replica
    sees other rows; the same mask pattern everywhere would correlate them).
    """
    return ((seed % 2**23) * 2**28 + step % 2**28) * 2**12 + replica % 2**12


def train_epoch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    log_every: int = 5,
    on_log: Callable[[int, torch.Tensor], None] | None = None,
    after_step: Callable[[int, torch.Tensor], None] | None = None,
    max_batches: int | None = None,
    seed: int | None = None,
    first_step: int = 0,
    replica: int = 0,
    totals: torch.Tensor | None = None,
    position: int = 0,
) -> torch.Tensor:
    """Train over device ``batches``; return the epoch's ``[loss_sum, correct, count]``.

    ``batches`` yields ``(x, y)`` already on the device (``pl.MpDeviceLoader``, which also
    cuts the graph after every batch). ``position``: batches of this epoch already run
    (resuming mid-epoch), ``totals``: their ``[loss_sum, correct, count]`` on the device.
    Whenever ``position + k`` is a multiple of ``log_every``, ``on_log(position + k,
    totals)`` is queued with ``xm.add_step_closure``: it runs after step ``k`` has
    executed, with the running totals as a materialised device tensor (read it with
    ``.cpu()``: that is the only device-to-host transfer of the loop). ``after_step(k,
    totals)`` runs on the host right after step ``k`` is traced (progress bars,
    checkpoints). Stops after ``max_batches``.

    With ``seed``, the device RNG (dropout) is set to
    ``step_seed(seed, first_step + k, replica)`` before step ``k``: the random numbers
    then depend only on the seed, the global step and the replica, not on how many syncs
    or checkpoints came before, so a resumed run draws exactly what an uninterrupted one
    draws. (The seed is a graph input, not a constant: no recompiles.)
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    model.train()
    device = next(model.parameters()).device
    if totals is None:  # device data, not a graph op: the same graph every step
        totals = torch.zeros(3).to(device)
    k = 0
    for x, y in batches:
        if seed is not None:
            xm.set_rng_state(step_seed(seed, first_step + k + 1, replica))
        totals = totals + train_step(model, optimizer, x, y)
        k += 1
        if on_log is not None and (position + k) % log_every == 0:
            xm.add_step_closure(on_log, args=(position + k, totals))
        if after_step is not None:
            after_step(k, totals)
        if max_batches is not None and k >= max_batches:
            break
    torch_xla.sync()  # run what is pending (and its closures) if we stopped early
    return totals


def evaluate(model: torch.nn.Module,
             batches: Iterable[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """``[loss_sum, correct, count]`` over the real (unmasked) rows, summed over replicas.

    ``batches`` yields ``(x, y, index, mask)`` on the device (``make_eval_loader``): every
    batch is full, padding rows have ``mask == False`` and count for nothing.
    """
    import torch_xla.core.xla_model as xm

    model.eval()
    device = next(model.parameters()).device
    totals = torch.zeros(3).to(device)
    with torch.no_grad():
        for x, y, _index, mask in batches:
            logits = model(x)
            m = mask.to(logits.dtype)
            loss = F.cross_entropy(logits, y, reduction="none")
            stats = torch.stack([(loss * m).sum(),
                                 ((logits.argmax(1) == y) & mask).sum().to(m.dtype), m.sum()])
            # reduced inside the step graph: no extra graph (and compile) after the loop
            totals = totals + xm.all_reduce(xm.REDUCE_SUM, stats)
    return totals


class SkipBatches:
    """A loader without its first ``skip`` batches (resuming in the middle of an epoch)."""

    def __init__(self, loader: Any, skip: int) -> None:
        if not 0 <= skip <= len(loader):
            raise ValueError(f"cannot skip {skip} of {len(loader)} batches")
        self.loader, self.skip = loader, skip

    def __len__(self) -> int:
        return len(self.loader) - self.skip

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        for _ in range(self.skip):
            next(it)
        return it


# --------------------------------------------------------------------------- results


@dataclass
class RunResult:
    """What :func:`train` returns: the master's history plus where the files are."""

    history: dict[str, Any]
    out_dir: Path

    @property
    def checkpoints(self) -> CheckpointDir:
        return CheckpointDir(self.out_dir / "checkpoints", keep=None)

    @property
    def final_eval_acc(self) -> float:
        return float(self.history["epochs"][-1]["eval_acc"])

    def epochs_frame(self):
        """Per-epoch metrics (and compile/transfer counts) as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.history["epochs"]).set_index("epoch")

    def log_frame(self):
        """The logged points (every ``log_every`` steps) as a DataFrame indexed by step."""
        import pandas as pd

        return pd.DataFrame(self.history["log"]).set_index("step")

    def final_weights(self) -> dict[str, torch.Tensor]:
        from tpu_helpers.checkpoint import load_checkpoint

        return load_checkpoint(self.out_dir / "final.pt")["model"]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# --------------------------------------------------------------------------- one replica


@dataclass
class _Logger:
    """Master-only logging from step closures: windowed loss/accuracy, progress bar."""

    first_step: int
    is_master: bool
    bar: Any = None
    rows: list[dict[str, float]] = field(default_factory=list)
    _prev: tuple[float, ...] = (0.0, 0.0, 0.0)

    def new_epoch(self, first_step: int, prev: Iterable[float] | None = None) -> None:
        """``first_step``: the global step before the epoch's first batch; ``prev``: the
        totals at the epoch's last log point (resuming mid-epoch), else zeros."""
        self.first_step = first_step
        self._prev = tuple(float(v) for v in prev) if prev is not None else (0.0, 0.0, 0.0)

    def __call__(self, k: int, totals: torch.Tensor) -> None:  # runs as a step closure
        loss_sum, correct, count = (float(v) for v in totals.cpu())  # the one transfer
        p = self._prev
        n = count - p[2]
        row = {"step": self.first_step + k, "loss": (loss_sum - p[0]) / n,
               "acc": (correct - p[1]) / n}
        self._prev = (loss_sum, correct, count)
        self.rows.append(row)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}",
                                 refresh=False)


def _replica_layout(spmd: bool) -> tuple[int, int, int]:
    """(world_size, rank, devices) of this replica."""
    import torch_xla.runtime as xr

    if spmd:
        return 1, 0, xr.global_runtime_device_count()
    return xr.world_size(), xr.global_ordinal(), xr.world_size()


def fit(config: TrainConfig) -> dict[str, Any]:
    """Train the digits CNN in THIS replica; return the history (the same on every replica).

    Call it inside the function given to ``torch_xla.launch`` (one call per replica), or
    in one process after ``xr.use_spmd()`` with ``config.spmd=True``. If
    ``config.out_dir`` is set, checkpoints go to ``out_dir/checkpoints`` (resumed from
    when ``config.resume``), and the writer saves ``final.pt`` and ``history.json``.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr

    from course.datasets import load_digits
    from course.models import DigitsCNN
    from tpu_helpers.compile_cache import cache_counters, compile_cache_dir, enable_compile_cache
    from tpu_helpers.data import ArrayDataset, make_eval_loader, make_train_loader
    from tpu_helpers.metrics import track

    if config.spmd != xr.is_spmd():
        raise RuntimeError(
            "config.spmd=True needs xr.use_spmd() first" if config.spmd else
            "this process is in SPMD mode: pass config.spmd=True (or run under launch)")
    cache = config.compile_cache
    if cache == "auto":
        from tpu_helpers.env import detect_runtime

        # Without a TPU the cache is written but cannot be read back (XLA:CPU, 2.9): skip.
        cache = str(compile_cache_dir().path) if detect_runtime().has_tpu else None
    if cache:
        enable_compile_cache(cache, replica=None if config.spmd else xr.global_ordinal())
    world, rank, devices = _replica_layout(config.spmd)
    for name in ("batch_size", "eval_batch_size"):
        size = getattr(config, name)
        if size % devices:
            raise ValueError(f"{name}={size} does not split evenly over {devices} devices; "
                             f"use a multiple of {devices}")
    device = torch_xla.device()
    is_master = xm.is_master_ordinal(local=False)

    train_x, train_y = load_digits("train", root=config.data_root)
    test_x, test_y = load_digits("test", root=config.data_root)
    train_loader = make_train_loader(ArrayDataset(train_x, train_y), config.batch_size // world,
                                     world_size=world, rank=rank, seed=config.seed)
    eval_loader = make_eval_loader(ArrayDataset(test_x, test_y),
                                   config.eval_batch_size // world, world_size=world, rank=rank)
    sharding = None
    if config.spmd:
        import torch_xla.distributed.spmd as xs

        from tpu_helpers.spmd import device_mesh

        # Rank-4 tensors (images) are split on the batch axis; labels, indices and
        # masks (rank 1) do not match the spec and stay replicated.
        sharding = xs.ShardingSpec(device_mesh(("data",)), ("data", None, None, None))
    steps_per_epoch = len(train_loader)

    torch.manual_seed(config.seed)
    model = DigitsCNN().to(device)
    xm.set_rng_state(config.seed)  # train_epoch re-seeds it from (seed, step) every step
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)

    ckpts = None
    if config.out_dir:
        ckpts = CheckpointDir(Path(config.out_dir) / "checkpoints", keep=config.keep,
                              storage=config.storage)
    settings = run_settings(config, world, devices, steps_per_epoch, len(train_x))
    history: dict[str, Any] = {
        **settings, "epochs": [], "log": [], "best_eval_acc": None, "best_epoch": None,
        "resumed_from": [], "config": _config_dict(config),
        "runs": [{"from_step": 0, "checkpoint": None, "settings": settings}],
    }
    epoch, skip, step = 0, 0, 0
    epoch_rng = resume_totals = resume_prev = None
    saved_at: list[int] = []  # steps checkpointed by this process (same on every replica)
    if ckpts is not None and config.resume:
        ckpt, path = ckpts.load_latest()
        if ckpt is not None:
            resumed = resume_from(ckpt, path, config, settings, model, optimizer)
            epoch, skip, step, history = resumed.epoch, resumed.skip, resumed.step, resumed.history
            epoch_rng, resume_totals, resume_prev = resumed.epoch_rng, resumed.totals, resumed.prev

    logger = _Logger(first_step=step, is_master=is_master)
    # the same formula fresh, resumed, or resumed with a new steps_per_epoch
    total_steps = step - skip + (config.epochs - epoch) * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    if is_master and config.progress == "bar" and step < total_steps:
        from tqdm import tqdm

        logger.bar = tqdm(total=total_steps, initial=step, desc=history["mode"],
                          file=sys.stdout, dynamic_ncols=False, ncols=90, mininterval=0.5)

    def state_now(next_epoch: int, next_batch: int, host_rng: dict[str, Any] | None = None,
                  totals: torch.Tensor | None = None) -> dict[str, Any]:
        torch_xla.sync()  # run the pending step and its logging closures first
        history["log"] = list(history["log"]) + logger.rows
        logger.rows = []
        extra: dict[str, Any] = {"history": history, "settings": settings}
        if next_batch:  # mid-epoch: what the rest of the epoch continues from
            extra.update(epoch_totals=totals, log_prev=list(logger._prev))
        return capture_training_state(model, optimizer, epoch=next_epoch,
                                      batch_in_epoch=next_batch, step=step,
                                      host_rng=host_rng, extra=extra)

    while epoch < config.epochs and step < total_steps:
        if epoch_rng is None:
            epoch_rng = rng_state()  # host RNGs as of the epoch start (the loader draws)
        else:
            from tpu_helpers.checkpoint import restore_rng_state

            restore_rng_state({**epoch_rng, "xla": None})
        train_loader.sampler.set_epoch(epoch)
        run_now = min(steps_per_epoch - skip, total_steps - step)
        first = step
        logger.new_epoch(first - skip, resume_prev)
        start_totals = None if resume_totals is None else resume_totals.to(device)
        resume_totals = resume_prev = None

        def after_step(k: int, totals: torch.Tensor, first: int = first,
                       this_epoch: int = epoch, skip: int = skip,
                       epoch_rng: dict[str, Any] = epoch_rng) -> None:
            nonlocal step
            step = first + k
            due = step in config.checkpoint_steps or (
                config.checkpoint_every and step % config.checkpoint_every == 0)
            if ckpts is not None and due and skip + k < steps_per_epoch:
                ckpts.save(state_now(this_epoch, skip + k, epoch_rng, totals), step)
                saved_at.append(step)
            if logger.bar is not None:
                logger.bar.update(1)
            elif is_master and config.progress == "lines":
                print(f"step {step}/{total_steps}", flush=True)

        device_batches = pl.MpDeviceLoader(SkipBatches(train_loader, skip), device,
                                           input_sharding=sharding)
        started = time.perf_counter()
        with track() as train_counts:
            train_totals = train_epoch(model, optimizer, device_batches,
                                       log_every=config.log_every,
                                       on_log=logger if is_master else None,
                                       after_step=after_step, max_batches=run_now,
                                       seed=config.seed, first_step=first, replica=rank,
                                       totals=start_totals, position=skip)
        train_seconds = time.perf_counter() - started
        if skip + run_now < steps_per_epoch:  # stopped by max_steps inside the epoch
            if ckpts is not None and saved_at[-1:] != [step]:
                ckpts.save(state_now(epoch, skip + run_now, epoch_rng, train_totals), step)
            break
        with track() as eval_counts:
            eval_totals = evaluate(model, pl.MpDeviceLoader(eval_loader, device,
                                                            input_sharding=sharding))
            torch_xla.sync()
        tr = [float(v) for v in train_totals.cpu()]  # end of epoch: two small reads
        ev = [float(v) for v in eval_totals.cpu()]
        # Metrics cover the whole epoch, also when it was resumed in the middle; the
        # seconds and counts cover the part this process ran (run_now steps).
        row = {
            "epoch": epoch + 1, "steps": steps_per_epoch, "step": step,
            "train_loss": tr[0] / tr[2], "train_acc": tr[1] / tr[2],
            "eval_loss": ev[0] / ev[2], "eval_acc": ev[1] / ev[2], "eval_count": int(ev[2]),
            "train_seconds": round(train_seconds, 3),
            "steps_per_s": round(run_now / train_seconds, 2),
            "train_compiles": train_counts.counts.compiles,
            "train_transfers_from_device": train_counts.counts.transfers_from_device,
            "log_reads": (steps_per_epoch // config.log_every - skip // config.log_every
                          if is_master else 0),
            "eval_compiles": eval_counts.counts.compiles,
            "eval_transfers_from_device": eval_counts.counts.transfers_from_device,
        }
        history["epochs"].append(row)
        # "best" from the reduced metric: the same number, so the same decision, everywhere
        improved = history["best_eval_acc"] is None or row["eval_acc"] > history["best_eval_acc"]
        if improved:
            history["best_eval_acc"], history["best_epoch"] = row["eval_acc"], epoch + 1
        epoch, skip, epoch_rng = epoch + 1, 0, None
        if ckpts is not None:
            state = state_now(epoch, 0)
            ckpts.save(state, step)
            if improved:
                ckpts.save_best(state)

    if logger.bar is not None:
        logger.bar.close()
    history["log"] = list(history["log"]) + logger.rows
    history["total_steps"] = step
    history["compile_cache"] = cache_counters()
    if config.out_dir:
        out = Path(config.out_dir)
        save_checkpoint(out / "final.pt", {"model": model.state_dict(), "step": step},
                        storage=config.storage)
        if is_checkpoint_writer(config.storage):
            save_history(out / "history.json", history)
    return history


def run_settings(config: TrainConfig, world_size: int, devices: int, steps_per_epoch: int,
                 train_samples: int) -> dict[str, Any]:
    """What a checkpoint's step counter and RNG streams mean: a resume must match these.

    The batch a step reads depends on the global batch size, how the data is sharded
    (mode, world size, devices), the shuffle seed and the training set's size.
    """
    return {"mode": "spmd" if config.spmd else "launch", "world_size": world_size,
            "devices": devices, "batch_size": config.batch_size, "seed": config.seed,
            "train_samples": train_samples, "steps_per_epoch": steps_per_epoch}


class ResumeMismatch(CheckpointError):
    """The newest checkpoint was written with other run settings than this run's."""


@dataclass(frozen=True)
class Resumed:
    """Where :func:`resume_from` says the run continues, and the state it continues with."""

    epoch: int
    skip: int  # batches of ``epoch`` already run
    step: int
    history: dict[str, Any]
    epoch_rng: dict[str, Any] | None  # host RNGs as of the epoch start (mid-epoch only)
    totals: torch.Tensor | None  # the epoch's [loss_sum, correct, count] so far
    prev: list[float] | None  # those totals at the epoch's last log point


def resume_from(ckpt: dict[str, Any], path: Path, config: TrainConfig,
                settings: dict[str, Any], model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> Resumed:
    """Restore ``ckpt`` (read from ``path``) into ``model``/``optimizer``; say where to go on.

    The checkpoint's run settings (:func:`run_settings`) must equal ``settings``: else
    :class:`ResumeMismatch` names the checkpoint and each setting's two values, unless
    ``config.resume_new_settings``, which keeps the weights and optimizer state and starts
    the checkpoint's next epoch (the current one if it was saved at an epoch end) with
    the new settings, recorded in ``history["runs"]``.
    """
    saved = ckpt.get("extra", {}).get("settings")
    changes = ([f"{k}={saved.get(k)!r} in the checkpoint, {v!r} now"
                for k, v in settings.items() if saved.get(k) != v]
               if isinstance(saved, dict) else ["no run settings stored (an older format)"])
    if changes and not config.resume_new_settings:
        raise ResumeMismatch(
            f"{path}: written with other run settings ({'; '.join(changes)}), so its step "
            "counter would mean other batches. Start over (--no-resume, or another "
            "--out-dir), or keep its weights and optimizer state and start a new epoch with "
            "these settings (--resume-new-settings, TrainConfig(resume_new_settings=True)).")
    where = restore_training_state(ckpt, model, optimizer, source=str(path))
    history = where.extra["history"]
    history["resumed_from"].append(path.name)
    history["config"] = _config_dict(config)
    history.setdefault("runs", []).append(
        {"from_step": where.step, "checkpoint": path.name, "settings": settings,
         "new_settings": bool(changes)})
    history.update(settings)
    extra = ckpt.get("extra", {})
    if changes:  # a new epoch with the new settings
        return Resumed(where.epoch + (1 if where.batch_in_epoch else 0), 0, where.step,
                       history, None, None, None)
    mid = where.batch_in_epoch > 0
    return Resumed(where.epoch, where.batch_in_epoch, where.step, history, ckpt["rng"],
                   extra.get("epoch_totals") if mid else None,
                   extra.get("log_prev") if mid else None)


def save_history(path: str | os.PathLike[str], history: dict[str, Any]) -> Path:
    """Write ``history`` as JSON with :func:`tpu_helpers.checkpoint.atomic_write`."""
    return atomic_write(path, lambda f: f.write(json.dumps(history, indent=1).encode()))


def _config_dict(config: TrainConfig) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    d["checkpoint_steps"] = list(d["checkpoint_steps"])
    return d


# --------------------------------------------------------------------------- launch


class ReplicaFailed(RuntimeError):
    """A replica of ``torch_xla.launch`` failed: which rank, what, and its traceback."""

    def __init__(self, rank: int | None, summary: str, details: str = "") -> None:
        self.rank, self.summary, self.details = rank, summary, details
        who = "a replica" if rank is None else f"rank {rank}"
        super().__init__(f"{who} failed: {summary}" + (f"\n\n{details}" if details else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across the process pool
        return (ReplicaFailed, (self.rank, self.summary, self.details))


class _Reported:
    """Picklable per-replica wrapper: record start, exceptions and native crashes per rank."""

    _crash_files: dict[str, Any] = {}  # per process: the file faulthandler writes to

    def __init__(self, fn: Callable[..., Any], report_dir: str) -> None:
        self.fn, self.report_dir = fn, report_dir

    def _watch_crashes(self) -> None:
        # One faulthandler file per process (v2/v3 run 2 replicas as threads of a process).
        crash = str(Path(self.report_dir) / f"pid-{os.getpid()}.crash")
        if crash not in self._crash_files:
            self._crash_files[crash] = open(crash, "w")  # noqa: SIM115 (lives with the process)
            faulthandler.enable(file=self._crash_files[crash], all_threads=True)

    def __call__(self, rank: int, *args: Any) -> Any:
        base = Path(self.report_dir) / f"rank-{rank}"
        self._watch_crashes()
        Path(f"{base}.started").write_text(str(os.getpid()))
        try:
            result = self.fn(rank, *args)
        except BaseException as exc:
            details = traceback.format_exc()
            Path(f"{base}.error").write_text(details)
            raise ReplicaFailed(rank, f"{type(exc).__name__}: {exc}", details) from None
        Path(f"{base}.done").touch()
        return result


def _crash_report(report_dir: Path) -> tuple[int | None, str]:
    """Which rank started but never finished, and its process's faulthandler dump if any."""
    for started in sorted(report_dir.glob("rank-*.started")):
        rank = int(started.name.split("-")[1].split(".")[0])
        base = report_dir / f"rank-{rank}"
        if Path(f"{base}.done").exists() or Path(f"{base}.error").exists():
            continue
        crash = report_dir / f"pid-{started.read_text().strip()}.crash"
        dump = crash.read_text().strip() if crash.exists() else ""
        return rank, dump
    return None, ""


def launch(fn: Callable[..., Any], args: tuple[Any, ...] = (), *,
           start_method: str = "fork") -> None:
    """``torch_xla.launch(fn, args, start_method)`` with failures reported per rank.

    ``fn(rank, *args)`` runs once per replica, as with ``torch_xla.launch``. If a replica
    raises, this raises :class:`ReplicaFailed` with the rank, the exception and the
    replica's full original traceback. If a replica dies without a Python exception (a
    segfault or abort in native code, ``os._exit``, the OOM killer), the process pool
    would only say ``BrokenProcessPool``; this names the rank and shows the Python stack
    faulthandler dumped at the crash (signals it can catch: SIGSEGV, SIGFPE, SIGABRT,
    SIGBUS, SIGILL; a SIGKILL leaves no stack).

    Use ``start_method='fork'`` in notebooks (``spawn`` cannot re-import a notebook's
    functions); scripts can use either.
    """
    import torch_xla

    report_dir = Path(tempfile.mkdtemp(prefix="tpu_helpers-launch-"))
    try:
        torch_xla.launch(_Reported(fn, str(report_dir)), args=args, start_method=start_method)
    except ReplicaFailed:
        raise
    except BrokenProcessPool as exc:
        rank, dump = _crash_report(report_dir)
        raise ReplicaFailed(
            rank, "the process died without a Python exception (killed by a signal, "
            "os._exit, or a crash in native code)",
            dump or "(no Python stack was dumped: SIGKILL or os._exit)") from exc
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


def _replica_main(rank: int, config: TrainConfig) -> None:
    fit(config)


def train(config: TrainConfig, *, start_method: str = "fork") -> RunResult:
    """Run :func:`fit` on every replica (``torch_xla.launch``) or under SPMD; return results.

    Launch mode: the calling process must not have touched the XLA device (launch
    forks/spawns the replicas, which do). SPMD mode (``config.spmd``): runs here, after
    ``xr.use_spmd()`` (called for you if needed). Results come back through
    ``out_dir`` (a new temp folder if ``config.out_dir`` is None): ``history.json``,
    ``final.pt`` and ``checkpoints/``.
    """
    out = Path(config.out_dir or tempfile.mkdtemp(prefix="tpu_helpers-run-"))
    out.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(config, out_dir=str(out))
    if config.spmd:
        import torch_xla.runtime as xr

        if not xr.is_spmd():
            xr.use_spmd()
        history = fit(config)
    else:
        launch(_replica_main, args=(config,), start_method=start_method)
        summary = out / "history.json"
        if not summary.is_file():
            raise FileNotFoundError(
                f"{summary} was not written on this host: with storage='shared' only global "
                "ordinal 0 writes, so OUT_DIR must be a folder every host sees (NFS, a "
                "mounted bucket); for each host's own disk use storage='local'.")
        history = json.loads(summary.read_text())
    return RunResult(history=history, out_dir=out)


# --------------------------------------------------------------------------- the script


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m tpu_helpers.train",
        description="Train the digits CNN on every TPU core (or the XLA:CPU emulation): "
                    "torch_xla.launch (one process per device) or SPMD (--spmd). Resumes "
                    "from the newest checkpoint in OUT_DIR/checkpoints. The same command "
                    "runs on every worker of a multi-host TPU pod.")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch: samples per step over all replicas (default %(default)s)")
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every,
                   help="read loss/accuracy back every N steps (default %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N steps in total")
    p.add_argument("--spmd", action="store_true",
                   help="one process per host, batch sharded over all devices (xr.use_spmd)")
    p.add_argument("--out-dir", default="runs/digits",
                   help="checkpoints/, history.json, final.pt (default %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every N steps (default: end of each epoch only)")
    p.add_argument("--keep", type=int, default=d.keep, help="step checkpoints to keep")
    p.add_argument("--storage", choices=("shared", "local"), default=d.storage,
                   help="shared: OUT_DIR is one folder for all hosts, global ordinal 0 "
                        "writes; local: each host has its own disk, local ordinal 0 of "
                        "each host writes (default %(default)s)")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--resume-new-settings", action="store_true",
                   help="the newest checkpoint was written with another batch size, device "
                        "count, mode or seed: keep its weights and optimizer state and "
                        "start its next epoch with these settings (default: refuse)")
    p.add_argument("--progress", choices=PROGRESS_KINDS, default=d.progress)
    p.add_argument("--compile-cache", default="auto", metavar="auto|off|PATH",
                   help="persistent XLA compile cache (default: auto = on a TPU the "
                        "per-runtime folder of tpu_helpers.compile_cache, off on XLA:CPU "
                        "which cannot read it back; a PATH is always used)")
    p.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                   help="how torch_xla.launch starts replicas (default %(default)s)")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="without a TPU: number of emulated XLA:CPU devices (default 1 for "
                        "launch, 4 for --spmd; launch needs 1 on XLA:CPU)")
    p.add_argument("--data", default=None, help="data folder (default: repo data/ or "
                                                "$TPU_NB_DATA)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from tpu_helpers.env import EnvironmentProblem, configure_emulation

    if not args.spmd and os.environ.get("XLA_USE_SPMD", "0") not in ("", "0"):
        # xr.use_spmd() sets XLA_USE_SPMD=1, and child processes inherit it.
        raise EnvironmentProblem(
            "XLA_USE_SPMD is set in the environment (inherited from an SPMD process?) but "
            "--spmd was not given, and torch_xla.launch cannot run under SPMD: pass --spmd "
            "or unset XLA_USE_SPMD.")

    runtime = configure_emulation(num_devices=args.cpu_devices or (4 if args.spmd else 1))
    config = TrainConfig(
        epochs=args.epochs, batch_size=args.batch_size, eval_batch_size=args.eval_batch_size,
        lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, log_every=args.log_every,
        max_steps=args.max_steps, spmd=args.spmd, out_dir=args.out_dir,
        checkpoint_every=args.checkpoint_every, keep=args.keep, storage=args.storage,
        resume=not args.no_resume, resume_new_settings=args.resume_new_settings,
        progress=args.progress,
        compile_cache=None if args.compile_cache == "off" else args.compile_cache,
        data_root=args.data)
    print(f"{runtime.summary()}; mode {'SPMD' if args.spmd else 'torch_xla.launch'}",
          flush=True)
    result = train(config, start_method=args.start_method)
    h = result.history
    last = h["epochs"][-1] if h["epochs"] else None
    where = f"; resumed from {', '.join(h['resumed_from'])}" if h["resumed_from"] else ""
    if last is not None:
        print(f"done: {h['total_steps']} steps, world size {h['world_size']} on "
              f"{h['devices']} device(s), epoch {last['epoch']} held-out accuracy "
              f"{last['eval_acc']:.4f} (best {h['best_eval_acc']:.4f}){where}; "
              f"files in {result.out_dir}", flush=True)
    else:
        print(f"done: {h['total_steps']} steps{where}; files in {result.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
