"""Multi-core training the way upstream writes it: one per-replica :func:`fit`, read top to bottom.

Taught in notebook 03 (``#@save``: :func:`train_step`, :func:`step_seed`, :func:`train_epoch`);
copy it with ``checkpoint.py``, ``data.py``, ``launch.py``. Also a script: ``python -m
tpu_helpers.train --help`` lists :class:`Config`'s flags. A resume continues bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import tempfile
import time
import warnings
from collections.abc import Callable
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
from torch.utils.data import Dataset

try:  # inside the tpu_helpers package
    from . import checkpoint
    from .data import AnyData, fit_datasets, fit_layout, make_loaders, set_epoch
    from .launch import hang_watchdog, launch
except ImportError:  # copied next to checkpoint.py, data.py and launch.py
    import checkpoint  # type: ignore[no-redef]
    from launch import hang_watchdog, launch  # type: ignore[no-redef]

    from data import AnyData, fit_datasets, fit_layout, make_loaders, set_epoch


_opt = lambda default, help, **kw: field(default=default, metadata={"help": help, **kw})  # noqa: A002


@dataclass(frozen=True)
class Config:
    """Every option of a run; ``python -m tpu_helpers.train --help`` lists the same fields."""

    epochs: int = _opt(6, "epochs to train")
    global_batch: int = _opt(64, "samples per optimizer step over ALL replicas (each loads "
                             "split_global_batch(global_batch, world_size): it must divide)")
    eval_global_batch: int = _opt(64, "evaluation samples per step over ALL replicas")
    lr: float = _opt(3e-3, "learning rate (the built-in optimizers; yours reads config.lr)")
    weight_decay: float = _opt(1e-2, "AdamW weight decay (built-in optimizer)")
    optimizer: str = _opt("adamw", "built-in optimizer", choices=("adamw", "sgd"))
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
    compile_cache: str = _opt("", "XLA compile cache folder; 2.8/2.9 write it, never load it "
                              "back (pytorch/xla issue 9094): no compile saved (default: off)")
    start_method: str = _opt("fork", "how launch starts replicas", choices=("fork", "spawn"))
    watchdog: float = _opt(120.0, "seconds before a stalled replica stops the run (0: off)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if f.name in ("epochs", "global_batch", "eval_global_batch", "log_every", "keep",
                          "max_steps") and value is not None and value < 1:  # None: no limit
                raise ValueError(f"{f.name} must be >= 1, got {value}")
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")


def Net(num_classes: int = 10, width: int = 16) -> nn.Module:  # noqa: N802 (a model class)
    """The script's model: two 3x3 convolutions, a max-pool, dropout, two linear layers."""
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.Conv2d(
        width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4), nn.Flatten(),
        nn.Dropout(0.25), nn.Linear(2 * width * 16, 64), nn.ReLU(), nn.Linear(64, num_classes))


class TrainingDiverged(FloatingPointError):
    """The training loss became NaN or infinite (the error names the step and the lr)."""


@functools.lru_cache(maxsize=16)
def device_scalar(n, dtype, device):
    """``n`` on the device, made once: a Python number in a traced op costs host time per step."""
    return torch.tensor(n, dtype=dtype, device=device)


def train_step(model, optimizer, x, y, loss_fn=F.cross_entropy):
    """One step; returns ``[loss_sum, correct, count]`` summed over replicas, on the device."""
    optimizer.zero_grad(set_to_none=True)
    output = model(x)
    loss = loss_fn(output, y)
    loss.backward()
    xm.optimizer_step(optimizer)  # all-reduce the gradients across replicas, then step
    n = device_scalar(y.shape[0], loss.dtype, loss.device)  # few ops: each costs host time
    stats = torch.stack([loss.detach() * n, (output.argmax(1) == y).sum(dtype=loss.dtype), n])
    return xm.all_reduce(xm.REDUCE_SUM, stats) if xr.world_size() > 1 else stats  # 1: a clone


def step_seed(seed, step, rank=0):
    """Device RNG seed of ``step`` on ``rank``: a resumed run draws the same dropout masks."""
    return ((seed % 2**23) * 2**28 + step % 2**28) * 2**12 + rank % 2**12


def train_epoch(model, optimizer, batches, step, after_step, seed=0, rank=0,
                loss_fn=F.cross_entropy, totals=None, step_fn=train_step):
    """One pass; ``after_step(step, totals)`` logs, checkpoints, True stops; returns totals."""
    totals = (torch.zeros(3) if totals is None else totals).to(torch_xla.device())
    for x, y in batches:
        step += 1
        xm.set_rng_state(step_seed(seed, step, rank))  # dropout: the same masks on a resume
        totals = totals + step_fn(model, optimizer, x, y, loss_fn)  # fit's dicts: dict_step
        if after_step(step, totals):
            break
    return totals


def dict_stats(model: nn.Module, batch: dict[str, torch.Tensor],
               loss_fn: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A dict batch's loss and ``[loss_sum, correct, count]``: ``loss_fn(model(tokens, mask),
    batch)`` returns the mean loss over real rows (index >= 0) or ``(loss, correct, count)``."""
    out = loss_fn(model(batch["tokens"], batch["mask"]), batch)
    rows = (batch["index"] >= 0).sum()
    loss, correct, count = out if isinstance(out, tuple) else (out, torch.zeros_like(out), rows)
    count = torch.as_tensor(count).to(loss.dtype)
    return loss, torch.stack([loss.detach() * count, torch.as_tensor(correct).to(loss), count])


def dict_step(model, optimizer, batch, _, loss_fn):
    """:func:`train_step` of a dict batch (length buckets; ``fit`` pairs it with None)."""
    optimizer.zero_grad(set_to_none=True)
    loss, stats = dict_stats(model, batch, loss_fn)
    loss.backward()
    xm.optimizer_step(optimizer)
    return xm.all_reduce(xm.REDUCE_SUM, stats) if xr.world_size() > 1 else stats


def evaluate(model, batches, loss_fn=F.cross_entropy):
    """Real rows' ``[loss_sum, correct, count]`` over replicas: ``(x, y, [index,] mask)``/dicts."""
    model.eval()
    totals = torch.zeros(3).to(torch_xla.device())
    with torch.no_grad():
        for batch in batches:
            if isinstance(batch, dict):  # length buckets
                stats = dict_stats(model, batch, loss_fn)[1]
            else:
                x, y, *_, mask = batch  # per-row losses: loss_fn(..., reduction="none")
                output, m = model(x), mask.float()
                loss = loss_fn(output, y, reduction="none")
                stats = torch.stack([(loss * m).sum(), ((output.argmax(1) == y) & mask).sum()
                                     .float(), m.sum()])
            totals += xm.all_reduce(xm.REDUCE_SUM, stats) if xr.world_size() > 1 else stats
    model.train()
    return totals


def builtin_optimizer(params: Any, config: Config) -> torch.optim.Optimizer:
    """The built-in optimizer ``config.optimizer`` (``fit``'s default ``optimizer_fn``)."""
    if config.optimizer == "sgd":  # foreach: the same numbers, fewer Python calls to trace
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, foreach=True)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, foreach=True)


def fit(config: Config, data: AnyData = None, model_fn: Callable[[], nn.Module] = Net, *,
        eval_data: Dataset | None = None,
        loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
        optimizer_fn: Callable[[Any, Config], torch.optim.Optimizer] = builtin_optimizer,
        scheduler_fn: Callable[[Any, Config], Any] | None = None,
        loaders_fn: Callable[..., tuple[Any, Any]] = make_loaders) -> dict[str, Any]:
    """Train in THIS replica (in ``torch_xla.launch``'s function, or once under SPMD); returns
    the history. ``loaders_fn(train_set, eval_set, config, world, rank)``: (train, eval)."""
    device = torch_xla.device()
    world, rank, devices = fit_layout(config)
    if config.compile_cache:  # per replica, as upstream's test does; a problem only warns
        try:
            xr.initialize_cache(str(Path(config.compile_cache) / f"replica-{rank}"))
        except Exception as exc:  # an optimisation, never a reason to stop
            warnings.warn(f"compile cache not enabled ({exc})", RuntimeWarning, stacklevel=2)
    train_set, eval_set = fit_datasets(data, eval_data, config)
    train_loader, eval_loader = loaders_fn(train_set, eval_set, config, world, rank)
    dicts = isinstance(next(iter(train_loader), None), dict)  # length buckets: dict_step
    if config.spmd and dicts:
        raise ValueError("dict (length-bucket) batches are not supported with spmd=True yet")
    torch.manual_seed(config.seed)
    model = model_fn().to(device)
    if world > 1:  # v2/v3 run replicas as threads sharing one RNG: start from rank 0's weights
        xm.broadcast_master_param(model)
    optimizer = optimizer_fn(model.parameters(), config)
    scheduler = scheduler_fn(optimizer, config) if scheduler_fn else None
    sharding = None  # the SPMD delta: shard the batch axis over a 1-D mesh of all devices
    if config.spmd:
        ndim = torch.as_tensor(train_set[0][0]).ndim  # a sample's axes, after the batch's
        sharding = xs.ShardingSpec(xs.Mesh(np.arange(devices), (devices,), ("data",)),
                                   ("data",) + (None,) * ndim)
    settings = {"mode": "spmd" if config.spmd else "launch", "world_size": world,
                "devices": devices, "global_batch": config.global_batch, "seed": config.seed,
                "train_samples": len(train_set), "steps_per_epoch": len(train_loader)}
    run = start(config, settings, model, optimizer, scheduler)  # settings: what a step means
    while run.epoch < config.epochs and run.step < run.last:
        set_epoch(train_loader, run.epoch)
        loader = (b for b in pl.MpDeviceLoader(itertools.islice(train_loader, run.batch, None),
                  device, input_sharding=sharding) if not _tick(run.step, "step"))  # fetched
        started, compiles = time.perf_counter(), _compiles()
        totals = train_epoch(model, optimizer, ((b, None) for b in loader) if dicts else loader,
                             run.step, functools.partial(run.after_step, model, optimizer),
                             config.seed, rank, loss_fn, run.totals,
                             dict_step if dicts else train_step)
        torch_xla.sync()
        if run.batch < len(train_loader):
            break  # stopped by max_steps inside the epoch (after_step checkpointed it)
        seconds = time.perf_counter() - started
        held_out = None if eval_loader is None else evaluate(
            model, pl.MpDeviceLoader(eval_loader, device, input_sharding=sharding), loss_fn)
        run.end_epoch(model, optimizer, totals, held_out, seconds, _compiles() - compiles)
    return run.finish(model)


_compiles = lambda: int((met.metric_data("CompileTime") or (0,))[0])  # XLA compiles so far
_lr = lambda optimizer: float(optimizer.param_groups[0]["lr"])  # a host value: no sync
_tick = getattr(hang_watchdog, "tick", lambda step, phase: None)  # a no-op without a watchdog


class ResumeMismatch(checkpoint.CheckpointError):
    """The newest checkpoint was written with other run settings than this run's."""


@dataclass
class Run:
    """Where this replica is (what a checkpoint stores) and the history it reports."""

    config: Config
    settings: dict[str, Any]  # what a step counter means: the rows each step reads
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
        _tick(step, "eval" if self.batch == self.settings["steps_per_epoch"] else "data")  # then
        return self.step == self.last

    def _log(self, step: int, totals: torch.Tensor, lr: float) -> None:
        loss_sum, correct, count = totals.tolist()  # the loop's one device-to-host read
        _check_finite(loss_sum / count, step, lr)
        self.history["log"].append({"step": step, "loss": loss_sum / count,
                                    "acc": correct / count})
        if self.config.progress and self.master:
            print(f"[step {step}] loss {loss_sum / count:.4f} acc {correct / count:.3f}")

    def save(self, model: nn.Module, optimizer: Any, totals: torch.Tensor, best=False) -> None:
        """Checkpoint on every replica (capture syncs first: logging closures have run)."""
        if self.ckpts is None:
            return
        _tick(self.step, "checkpoint")
        extra = {"history": self.history, "settings": self.settings, "totals": totals,
                 **({} if self.scheduler is None else {"scheduler": self.scheduler.state_dict()})}
        state = checkpoint.capture_training_state(model, optimizer, epoch=self.epoch, extra=extra,
                                                  batch_in_epoch=self.batch, step=self.step)
        self.ckpts.save(state, self.step)
        if best:
            self.ckpts.save_best(state)

    def end_epoch(self, model: nn.Module, optimizer: Any, totals: torch.Tensor,
                  eval_totals: torch.Tensor | None, seconds: float, compiles: int) -> None:
        h, tr = self.history, totals.tolist()  # end of epoch: the two small reads
        _check_finite(tr[0] / tr[2], self.step, _lr(optimizer))
        ev = eval_totals.tolist() if eval_totals is not None else [float("nan"), 0.0, 1.0]
        row = {"epoch": self.epoch + 1, "steps": self.settings["steps_per_epoch"],
               "step": self.step, "lr": _lr(optimizer), "train_loss": tr[0] / tr[2],
               "train_acc": tr[1] / tr[2], "eval_loss": ev[0] / ev[2], "eval_acc": ev[1] / ev[2],
               "eval_count": int(ev[2]), "train_seconds": round(seconds, 3), "compiles": compiles}
        h["epochs"].append(row)
        best = h["best_eval_acc"] is None or row["eval_acc"] > h["best_eval_acc"]
        if best:  # from the reduced metric: the same decision on every replica
            h["best_eval_acc"], h["best_epoch"] = row["eval_acc"], self.epoch + 1
        if self.scheduler is not None and self.config.scheduler_step == "epoch":
            self.scheduler.step()  # before the checkpoint: a resume starts the next epoch
        self.epoch, self.batch, self.totals = self.epoch + 1, 0, torch.zeros(3)
        self.save(model, optimizer, torch.zeros(3), best=best)

    def finish(self, model: nn.Module) -> dict[str, Any]:
        h, c = self.history, self.config
        h["total_steps"], h["runs"][-1]["steps"] = self.step, self.step - self.from_step
        h["compile_cache"] = {n: int(met.counter_value(n) or 0) for n in met.counter_names()
                              if n.startswith("PersistentCache")}
        if self.step == self.from_step:  # e.g. train() called again with the same out_dir
            h["note"] = (f"0 steps run: resumed at step {self.step}, where epochs={c.epochs}, "
                         f"max_steps={c.max_steps} stop; raise them, or start over "
                         "(resume=False / --no-resume, or another out_dir)")
            if self.master:
                print(h["note"], flush=True)
        if c.out_dir and checkpoint.save_checkpoint(  # not None: this replica is the writer
                Path(c.out_dir) / "final.pt", {"model": model.state_dict(), "step": self.step},
                storage=c.storage) is not None:
            save_history(Path(c.out_dir) / "history.json", h)
        return h


def _check_finite(loss: float, step: int, lr: float) -> None:
    if not math.isfinite(loss):
        raise TrainingDiverged(f"the training loss is {loss} at step {step} (learning rate "
                               f"{lr:g}): lower the learning rate or check the data")


def start(config: Config, settings: dict[str, Any], model: nn.Module, optimizer: Any,
          scheduler: Any = None) -> Run:
    """A fresh :class:`Run`, or the one the newest checkpoint in ``out_dir`` continues."""
    ckpts = (checkpoint.CheckpointDir(Path(config.out_dir) / "checkpoints", keep=config.keep,
                                      storage=config.storage) if config.out_dir else None)
    ckpt, path = ckpts.load_latest() if ckpts and config.resume else (None, None)
    run = (Run(config, settings, {
        **settings, "epochs": [], "log": [], "best_eval_acc": None, "best_epoch": None,
        "resumed_from": [], "config": dataclasses.asdict(config),
        "runs": [{"from_step": 0, "checkpoint": None, "settings": settings}]})
        if ckpt is None else resume_from(ckpt, path, config, settings, model, optimizer, scheduler))
    run.ckpts, run.scheduler = ckpts, scheduler
    return run


def resume_from(ckpt: dict[str, Any], path: Path, config: Config, settings: dict[str, Any],
                model: nn.Module, optimizer: Any, scheduler: Any = None) -> Run:
    """Restore ``ckpt``; other settings raise :class:`ResumeMismatch` (unless
    ``config.resume_new_settings``: its weights and optimizer, its next epoch)."""
    saved = (extra := ckpt.get("extra", {})).get("settings")
    changes = ([f"{k}={saved.get(k)!r} in the checkpoint, {v!r} now"
                for k, v in settings.items() if saved.get(k) != v]
               if isinstance(saved, dict) else ["no run settings stored"])
    if (scheduler is None) != ("scheduler" not in extra):
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
    history["runs"].append({"from_step": where.step, "checkpoint": path.name,
                            "settings": settings, "new_settings": bool(changes)})
    history.update(settings, config=dataclasses.asdict(config))
    run = Run(config, settings, history, where.epoch, where.batch_in_epoch, where.step,
              where.extra["totals"], scheduler=scheduler, from_step=where.step)
    if changes and run.batch:  # new settings: a new epoch (its batches meant other rows)
        run.epoch, run.batch, run.totals = run.epoch + 1, 0, torch.zeros(3)
    return run


save_history = lambda path, history: checkpoint.atomic_write(  # history.json, atomically
    path, lambda f: f.write(json.dumps(history, indent=1).encode()))


def _replica(rank, config, data, model_fn, hooks):
    fit(config, data, model_fn, **hooks)


def train(config: Config, data: AnyData = None, model_fn: Callable[[], nn.Module] = Net,
          **hooks: Any) -> dict[str, Any]:
    """Run :func:`fit` on every replica (``launch``) or under SPMD; returns the history.
    ``hooks``: :func:`fit`'s keyword arguments (module-level functions: launch pickles them)."""
    out = Path(config.out_dir or tempfile.mkdtemp(prefix="tpu_helpers-run-"))
    config = dataclasses.replace(config, out_dir=str(out))
    if config.spmd:
        if not xr.is_spmd():
            xr.use_spmd()
        return fit(config, data, model_fn, **hooks)
    launch(_replica, args=(config, data, model_fn, hooks), start_method=config.start_method,
           watchdog=bool(config.watchdog and hang_watchdog) and {"min_timeout": config.watchdog})
    if not (out / "history.json").is_file():
        raise FileNotFoundError(f"{out / 'history.json'} not written on this host: storage="
                                "'shared' needs a folder every host sees, else use 'local'.")
    history = json.loads((out / "history.json").read_text())
    if "note" in history and history["runs"][-1].get("steps") == 0:
        warnings.warn(history["note"], RuntimeWarning, stacklevel=2)
    return history


def parser() -> argparse.ArgumentParser:
    """The command line, one flag per :class:`Config` field."""
    p = argparse.ArgumentParser(description="Train on every TPU core (or XLA:CPU); resumes "
                                "from OUT_DIR/checkpoints. Run it on every worker of a pod.")
    for f in dataclasses.fields(Config):
        kind = ({"action": argparse.BooleanOptionalAction} if f.type == "bool" else
                {"type": {"int": int, "float": float, "int | None": int}.get(f.type, str),
                 "choices": f.metadata.get("choices")})
        p.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kind,
                       help=f.metadata["help"] + " (%(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    h = train(Config(**vars(parser().parse_args(argv))))
    acc = f", held-out accuracy {h['epochs'][-1]['eval_acc']:.4f}" if h["epochs"] else ""
    resumed = f"; resumed from {', '.join(h['resumed_from'])}" if h["resumed_from"] else ""
    print(f"done: {h['total_steps']} steps, world size {h['world_size']} on {h['devices']} "
          f"device(s){acc}{resumed}; files in {h['config']['out_dir']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
