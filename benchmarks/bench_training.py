"""Training benchmark: one model, one dataset, five training loops, one table.

    python -m benchmarks.bench_training            # full run (a few minutes)
    python -m benchmarks.bench_training --quick    # CI-sized

Every row trains ``course.models.DigitsCNN`` on the shipped digits (train split,
1,437 images) with batch 64 for the same number of epochs:

  (a) the loop of the Q&A article "How can I train a PyTorch model on a TPU using a custom dataset?"
      (the custom-dataset article) as written: ``ParallelLoader``, Adam, ``loss.item()`` every 10
      steps, no ``drop_last``. Only names that were removed are replaced (``xm.xla_device`` ->
      ``torch_xla.device()``, removed ``xm.xrt_world_size`` -> ``xr.world_size()``, ``nprocs=8`` ->
      default) plus the one change without which it does not run at all: a ``ParallelLoader`` is not
      iterable (``TypeError``), so the loop iterates ``para_loader.per_device_loader(device)``. As
      written, the one ``ParallelLoader`` is created before the epoch loop and is exhausted after
      the first epoch, so the loop trains ONE epoch whatever ``num_epochs`` says (the "steps run"
      column shows it).
  (b) the canonical upstream pattern (pytorch/xla ``test/test_train_mp_mnist.py``):
      ``MpDeviceLoader``, SGD with momentum, ``xm.optimizer_step``, ``xm.RateTracker`` and
      ``xm.add_step_closure`` logging every 20 steps, upstream's flag defaults
      (``drop_last`` off), except ``num_workers=0`` (upstream's 4 worker processes only
      add start-up cost for in-memory data on a 2-core machine: this is the strongest
      version of the baseline) and ``xr.using_pjrt()`` (removed; PJRT is the only runtime).
  (c) Lightning's ``Trainer`` on XLA: ``Trainer(**tpu_helpers.tpu_lightning.trainer_kwargs(1))``
      with ``LitDigits`` (loss logged per epoch, no per-step sync), progress bar
      on (its output hidden), checkpointing and logger off, plain ``DataLoader``.
  (d) ours: ``tpu_helpers.train.fit`` itself (the per-replica function notebook 03 teaches)
      on this data without held-out data or checkpoints: its ``DataLoader`` +
      ``MpDeviceLoader``, AdamW, the device RNG seeded per step, logging every 20 steps in a
      step closure, one summary read per epoch. Timed from when its model and optimizer exist
      (as (b) and (e) are), through the end of ``fit``.
  (e) the ceiling: ``tpu_helpers.train.train_step`` on ``fit``'s batches already on the
      device, one sync per step, no loader, no logging.
  (d') and (e'): (d) and (e) with (b)'s optimizer, SGD(lr=0.01, momentum=0.5). Each source
      brings its own optimizer (Adam, SGD, AdamW) and on a small model the optimizer's
      share of a step is large (AdamW's update traces several ops per parameter), so
      (b) vs (d') is the comparison of the loops alone.

Each row runs in its own fresh Python process (its compile counts and peak host RSS are
its own), calling the per-process training function directly (world size 1: what
``torch_xla.launch`` / ``xmp.spawn`` would run in its one child on this machine). In that
process: one cold run (compiles), then warm runs, each timed from the start of its epoch
loop until the device has finished the last step. All row processes stay alive and the
parent asks them in turn for one warm run at a time (a..e', then e'..a, ...), so drifting
load on a shared machine hits every row alike; the table shows the median steps/s and
the min-max of the warm runs (7 per row; 3 with --quick).

Columns: steps/s (median), ratio to (d) and to (e), compiles during the first two steps
(warm-up, model set-up included) and after them, device-to-host transfers and graph
executions per step (warm runs; more than one execution per step means the host cut the
graph), CPU milliseconds per step (all threads of the process: much less inflated by other
load than wall time), host milliseconds per step (below), peak host RSS of the row's
process, steps run per run, and the 1-minute load average seen during the warm runs.

Host ms/step is the CPU time of the threads that trace and dispatch a step: the Python thread
that runs the loop plus PyTorch's autograd worker thread (``backward()`` of XLA tensors is
traced there), from ``/proc/self/task/*/schedstat``. XLA:CPU executes compiled graphs on
other threads, which it leaves out (tests/test_metrics_benchmarks.py: 1,000 times the
device work, the same host time), as it leaves out ``MpDeviceLoader``'s threads, which work
beside the step. On a TPU the device step of this model is far shorter than the host's
tracing, so host ms/step is what bounds steps/s there (expected, not yet run on a TPU).

  (f) and (g): (e') plus ours' per-step seed and totals, the step under
      ``torch_xla.compile`` (the lazy tracer between two syncs; the seed is set inside, or the
      first sync would move it) and with the model under ``torch.compile(backend="openxla")``
      (forward and backward as cached graphs, the optimizer lazy: compiling the whole step
      with the backward and ``optimizer.step()`` inside fails on 2.8 and 2.9 with "Check
      failed: cachedComputation"). (f) trains the lazy loop's losses bit for bit; (g) draws other
      dropout masks (the same losses only without dropout: tests/test_train_compiled.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks._common import quick_mode

REPO = Path(__file__).resolve().parent.parent
#: Rows per optimizer step over all replicas; one replica here, so also each DataLoader's batch.
GLOBAL_BATCH = 64
#: Ours and the upstream pattern log every 20 steps (upstream's default log_steps).
LOG_EVERY = 20
#: Compiles in the first WARMUP_STEPS steps count as warm-up.
WARMUP_STEPS = 2

ROWS = {
    "a": "(a) the custom-dataset article's loop as written (Adam)",
    "b": "(b) upstream test_train_mp_mnist pattern (SGD)",
    "c": "(c) Lightning Trainer on XLA (AdamW)",
    "d": "(d) ours: tpu_helpers.train (AdamW)",
    "e": "(e) ceiling: ours' step, data on device (AdamW)",
    "d_sgd": "(d') ours with (b)'s SGD",
    "e_sgd": "(e') ceiling with (b)'s SGD",
    "f": "(f) ours' step under torch_xla.compile (SGD)",
    "g": "(g) ours' step, model under torch.compile openxla (SGD)",
}
#: Ours and the ceiling with upstream's optimizer, so (b) vs (d') compares loops only.
UPSTREAM_SGD = {"lr": 0.01, "momentum": 0.5}


# --------------------------------------------------------------------------- measuring


def host_cpu_seconds() -> float:
    """CPU seconds of THIS thread plus PyTorch's autograd worker threads (``pt_autograd_*``,
    where ``backward()`` of XLA tensors is traced): the host work of tracing and dispatching a
    step. Not counted: the threads XLA:CPU executes compiled graphs on and the loader threads
    (``MpDeviceLoader``'s), which run beside the step. Linux: ``/proc/self/task/*/schedstat``."""
    import threading

    me, total = str(threading.get_native_id()), 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if tid == me or Path(f"/proc/self/task/{tid}/comm").read_text().startswith(
                    "pt_autograd"):
                total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except OSError:  # the thread ended
            continue
    return total / 1e9


class _Window:
    """Times one run's epoch loop and counts what XLA did in it (used by every row)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.host_seconds = 0.0
        self._c0 = self._h0 = 0.0
        self.counts: Any = None
        self.at_warmup: Any = None
        self.end: Any = None
        self._t0 = 0.0
        self._start: Any = None

    def start(self) -> None:
        import torch_xla.core.xla_model as xm

        from tpu_helpers.metrics import snapshot

        xm.wait_device_ops()
        self._start = snapshot()
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()
        self._h0 = host_cpu_seconds()

    def step(self) -> None:
        """Called once per training step, after the step was traced (pure Python)."""
        self.steps += 1
        if self.steps == WARMUP_STEPS + 1:  # steps 1..WARMUP_STEPS are compiled by now
            from tpu_helpers.metrics import snapshot

            self.at_warmup = snapshot()

    def stop(self) -> None:
        import torch_xla.core.xla_model as xm

        from tpu_helpers.metrics import snapshot

        xm.wait_device_ops()
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0
        self.host_seconds = host_cpu_seconds() - self._h0
        self.end = snapshot()
        self.counts = self.end - self._start


BENCH = _Window()


# ------------------------------------------------------------ (a) the custom-dataset article


def article_row(epochs: int, images, labels) -> None:
    """The custom-dataset article's second listing, as written; changes: ``# article:``."""
    import torch
    import torch.nn as nn
    import torch.optim as optim
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr
    from torch.utils.data import DataLoader, Dataset

    from course.models import DigitsCNN

    class CustomDataset(Dataset):
        def __init__(self, data, targets):
            self.data = data
            self.targets = targets

        def __len__(self):
            return len(self.data)

        def __getitem__(self, idx):
            return (torch.tensor(self.data[idx], dtype=torch.float32),
                    torch.tensor(self.targets[idx], dtype=torch.long))

    dataset = CustomDataset(images, labels)  # article: the dummy lists / image files

    def train_loop(index, flags):
        device = torch_xla.device()  # article: xm.xla_device() (deprecated)
        model = DigitsCNN().to(device)  # article: SimpleModel / ConvModel
        optimizer = optim.Adam(model.parameters(), lr=0.01)
        criterion = nn.CrossEntropyLoss()

        # article: xm.xrt_world_size() (removed in 2.7)
        data_loader = DataLoader(dataset, batch_size=flags['batch_size'] // xr.world_size(),
                                 shuffle=True)
        para_loader = pl.ParallelLoader(data_loader, [device])

        num_epochs = flags['num_epochs']  # article: 5
        BENCH.start()
        for epoch in range(num_epochs):
            # article: enumerate(para_loader) -> TypeError: 'ParallelLoader' object is not iterable
            for batch_idx, (data, target) in enumerate(para_loader.per_device_loader(device)):
                optimizer.zero_grad()
                output = model(data)
                loss = criterion(output, target)
                loss.backward()
                xm.optimizer_step(optimizer)

                if batch_idx % 10 == 0:
                    xm.master_print(f"Epoch {epoch}, Batch {batch_idx}: Loss {loss.item()}")
                BENCH.step()
        BENCH.stop()

    FLAGS = {}
    FLAGS['batch_size'] = GLOBAL_BATCH  # article: 8 (a per-core batch of 1 on 8 cores)
    FLAGS['num_epochs'] = epochs
    # article: xmp.spawn(train_loop, args=(FLAGS,), nprocs=8, start_method='fork'); nprocs may
    # only be 1 or None, and on this machine the spawn runs one process: we call its function.
    train_loop(0, FLAGS)


# --------------------------------------------------------------------------- (b) upstream


def upstream_row(epochs: int, images, labels) -> None:
    """pytorch/xla test/test_train_mp_mnist.py's training, current names; see module doc."""
    import torch
    import torch.nn as nn
    import torch.optim as optim
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr
    import torch_xla.test.test_utils as test_utils

    from course.models import DigitsCNN
    from tpu_helpers.data import ArrayDataset

    flags = SimpleNamespace(batch_size=GLOBAL_BATCH, num_epochs=epochs, num_workers=0,
                            drop_last=False, lr=0.01, momentum=0.5, log_steps=LOG_EVERY,
                            async_closures=False)

    def _train_update(device, step, loss, tracker, epoch, writer):
        test_utils.print_training_update(device, step, loss.item(), tracker.rate(),
                                         tracker.global_rate(), epoch, summary_writer=writer)

    def train_mnist(flags):
        torch.manual_seed(1)
        train_dataset = ArrayDataset(images, labels)  # upstream: torchvision MNIST
        train_sampler = None
        if xr.world_size() > 1:
            train_sampler = torch.utils.data.distributed.DistributedSampler(
                train_dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal(),
                shuffle=True)
        train_loader = torch.utils.data.DataLoader(
            train_dataset, batch_size=flags.batch_size, sampler=train_sampler,
            drop_last=flags.drop_last, shuffle=False if train_sampler else True,
            num_workers=flags.num_workers)

        lr = flags.lr * xr.world_size()
        device = torch_xla.device()
        model = DigitsCNN().to(device)  # upstream: MNIST()
        xm.broadcast_master_param(model)  # upstream: `if xr.using_pjrt():` (removed)
        writer = None
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=flags.momentum)
        loss_fn = nn.CrossEntropyLoss()  # upstream: NLLLoss on its model's log_softmax

        def train_loop_fn(loader, epoch):
            tracker = xm.RateTracker()
            model.train()
            for step, (data, target) in enumerate(loader):
                optimizer.zero_grad()
                output = model(data)
                loss = loss_fn(output, target)
                loss.backward()
                xm.optimizer_step(optimizer)
                tracker.add(flags.batch_size)
                if step % flags.log_steps == 0:
                    xm.add_step_closure(_train_update,
                                        args=(device, step, loss, tracker, epoch, writer),
                                        run_async=flags.async_closures)
                BENCH.step()

        train_device_loader = pl.MpDeviceLoader(train_loader, device)
        BENCH.start()
        for epoch in range(1, flags.num_epochs + 1):
            train_loop_fn(train_device_loader, epoch)
        BENCH.stop()

    train_mnist(flags)


# --------------------------------------------------------------------------- (c) Lightning


def lightning_row(epochs: int, images, labels) -> None:
    """Lightning 2.6's Trainer on the XLA device via tpu_helpers.tpu_lightning.trainer_kwargs."""
    import lightning as L
    from torch.utils.data import DataLoader

    from course.lightning_demo import LitDigits
    from course.lightning_demo import trainer_kwargs_here as trainer_kwargs
    from tpu_helpers.data import ArrayDataset

    class Window(L.Callback):
        def on_train_start(self, trainer, pl_module):
            BENCH.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            BENCH.step()

        def on_train_end(self, trainer, pl_module):
            BENCH.stop()

    loader = DataLoader(ArrayDataset(images, labels), batch_size=GLOBAL_BATCH, shuffle=True)
    with tempfile.TemporaryDirectory() as root, redirect_stderr(io.StringIO()), \
            redirect_stdout(io.StringIO()):
        trainer = L.Trainer(**trainer_kwargs(1), max_epochs=epochs, logger=False,
                            enable_checkpointing=False, enable_model_summary=False,
                            default_root_dir=root, callbacks=[Window()])
        trainer.fit(LitDigits(), loader)


# --------------------------------------------------------------------------- (d) ours


def ours_row(epochs: int, images, labels, sgd: bool = False) -> None:
    """tpu_helpers.train.fit itself, on this data, without evaluation or checkpoints."""
    from course.models import DigitsCNN
    from tpu_helpers.train import fit

    def model_fn():
        model = DigitsCNN()
        model.register_forward_pre_hook(lambda *_: BENCH.step())  # one forward per step
        return model

    def no_schedule(optimizer, config):  # fit calls it once the model and optimizer exist:
        BENCH.start()  # the window starts where (b)'s and (e)'s do
        return None  # fit's default: no scheduler

    fit(_config(epochs, sgd), (images, labels, None, None), model_fn, scheduler_fn=no_schedule)
    BENCH.stop()


def _config(epochs: int, sgd: bool):
    from tpu_helpers.train import Config

    config = Config(epochs=epochs, global_batch=GLOBAL_BATCH, log_every=LOG_EVERY)
    if sgd:
        return dataclasses.replace(config, optimizer="sgd", **UPSTREAM_SGD)
    return config


# --------------------------------------------------------------------------- (e) ceiling


def ceiling_row(epochs: int, images, labels, sgd: bool = False) -> None:
    """The compiled step on batches already on the device: no loader, no logging."""
    import torch
    import torch_xla
    from torch.utils.data import TensorDataset

    from course.models import DigitsCNN
    from tpu_helpers.train import builtin_optimizer, make_loaders, train_step

    config = _config(epochs, sgd)
    device = torch_xla.device()
    torch.manual_seed(config.seed)
    model = DigitsCNN().to(device)
    optimizer = builtin_optimizer(model.parameters(), config)
    train_set = TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))
    loader, _ = make_loaders(train_set, None, config, world=1, rank=0)
    batches = [(x.to(device), y.to(device)) for x, y in loader]
    torch_xla.sync()
    BENCH.start()
    for _ in range(epochs):
        for x, y in batches:
            train_step(model, optimizer, x, y)
            torch_xla.sync()
            BENCH.step()
    BENCH.stop()


_DYNAMO: dict[str, Any] = {}  # one compiled model per row process: warm runs reuse its graphs


def compiled_row(epochs: int, images, labels, how: str = "xla") -> None:
    """(e') plus ours' per-step seed and totals, compiled: ``torch_xla.compile`` (the lazy
    tracer between two syncs) or the model under ``torch.compile(backend="openxla")``."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch.utils.data import TensorDataset

    from course.models import DigitsCNN
    from tpu_helpers.train import builtin_optimizer, make_loaders, step_seed, train_step

    config = _config(epochs, sgd=True)
    device = torch_xla.device()
    torch.manual_seed(config.seed)
    if how == "xla" or not _DYNAMO:
        model = DigitsCNN().to(device)
        _DYNAMO.update(model=model, compiled=torch.compile(model, backend="openxla"))
    model = _DYNAMO["model"]
    optimizer = builtin_optimizer(model.parameters(), config)
    train_set = TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))
    loader, _ = make_loaders(train_set, None, config, world=1, rank=0)
    batches = [(x.to(device), y.to(device)) for x, y in loader]
    totals = torch.zeros(3, device=device)
    torch_xla.sync()

    def step(totals, x, y, k):  # the seed is set INSIDE: compile's first sync would move it
        xm.set_rng_state(step_seed(config.seed, k))
        return totals + train_step(_DYNAMO["compiled"] if how == "dynamo" else model,
                                   optimizer, x, y)

    compiled = torch_xla.compile(step, name="ours_step") if how == "xla" else None
    BENCH.start()
    for k, (x, y) in enumerate(batches * epochs, 1):
        if compiled is not None:
            totals = compiled(totals, x, y, k)
        else:
            totals = step(totals, x, y, k)
            torch_xla.sync()
        BENCH.step()
    BENCH.stop()


ROW_FUNCTIONS = {"a": article_row, "b": upstream_row, "c": lightning_row,
                 "d": ours_row, "e": ceiling_row,
                 "d_sgd": functools.partial(ours_row, sgd=True),
                 "e_sgd": functools.partial(ceiling_row, sgd=True),
                 "f": compiled_row, "g": functools.partial(compiled_row, how="dynamo")}


# --------------------------------------------------------------------------- one row


class _RowProcess:
    """The in-process side of one row: data loaded once, then cold and warm runs."""

    def __init__(self, key: str, epochs: int) -> None:
        from tpu_helpers.env import configure_emulation

        configure_emulation(num_devices=1)
        from course.datasets import load_digits

        self.key, self.epochs = key, epochs
        self.fn = ROW_FUNCTIONS[key]
        self.images, self.labels = load_digits("train")
        self.sink = io.StringIO()  # the loops' own log lines

    def cold(self) -> dict[str, Any]:
        """The first run: everything compiles; split into warm-up and after warm-up."""
        import torch_xla.core.xla_model as xm

        from tpu_helpers.metrics import snapshot

        before = snapshot()
        BENCH.reset()
        with redirect_stdout(self.sink):
            self.fn(self.epochs, self.images, self.labels)
        xm.wait_device_ops()
        total = snapshot() - before
        if BENCH.at_warmup is None:
            raise RuntimeError(f"row {self.key} ran only {BENCH.steps} steps")
        after = BENCH.end.compiles - BENCH.at_warmup.compiles
        return {"key": self.key, "epochs": self.epochs, "cold_compiles": total.compiles,
                "compiles_warmup": total.compiles - after, "compiles_after_warmup": after,
                "cold_steps": BENCH.steps}

    def warm(self) -> dict[str, Any]:
        """One more run with every graph compiled: timed and counted."""
        BENCH.reset()
        with redirect_stdout(self.sink):
            self.fn(self.epochs, self.images, self.labels)
        return {"steps": BENCH.steps, "seconds": BENCH.seconds, "cpu_seconds": BENCH.cpu_seconds,
                "host_seconds": BENCH.host_seconds,
                **{f"n_{k}": v for k, v in BENCH.counts.as_dict().items()}}

    @staticmethod
    def peak_rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure_row(key: str, epochs: int, repeats: int) -> dict[str, Any]:
    """In THIS process: a cold run, then ``repeats`` warm runs of row ``key``."""
    row = _RowProcess(key, epochs)
    result = row.cold()
    result["warm"] = [row.warm() for _ in range(repeats)]
    result["peak_rss_mb"] = row.peak_rss_mb()
    return result


_MARK = "@@bench-training "


def _serve(key: str, epochs: int) -> None:
    """Child side: a cold run, then one warm run per "run" line on stdin until "quit"."""
    out = sys.stdout
    row = _RowProcess(key, epochs)

    def send(message: dict[str, Any]) -> None:
        out.write(_MARK + json.dumps(message) + "\n")
        out.flush()

    send(row.cold())
    for line in sys.stdin:
        if line.strip() == "run":
            send(row.warm())
        else:
            break
    send({"peak_rss_mb": row.peak_rss_mb()})


class _Child:
    """Parent side of one row process."""

    def __init__(self, key: str, epochs: int, log_dir: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        self.key = key
        self.log = open(Path(log_dir) / f"{key}.stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_training", "--serve", key,
             "--epochs", str(epochs)], cwd=REPO, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK):])
        self.proc.wait()
        self.log.seek(0)
        raise RuntimeError(f"benchmark row {ROWS[self.key]} exited with "
                           f"{self.proc.returncode}:\n{self.log.read()[-4000:]}")

    def request(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def watchdog_tick_us(n: int = 100_000, rounds: int = 5) -> float:
    """Host microseconds of one ``hang_watchdog.tick`` into an open slot, as in a watched
    replica (``fit`` ticks twice per step: "step" when a batch arrives, "data" after the step);
    the median of ``rounds`` timings of ``n`` ticks, in a child process of its own."""
    code = f"""
import statistics, sys, tempfile, time
from tpu_helpers import hang_watchdog
hang_watchdog.start_replica(tempfile.mkdtemp(), 0, sample_every=None)
times = []
for _ in range({rounds}):
    start = time.perf_counter()
    for i in range({n}):
        hang_watchdog.tick(i, "step")
    times.append((time.perf_counter() - start) / {n} * 1e6)
print(statistics.median(times))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return float(out.stdout.split()[-1])


def summarise(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per loop: medians over every warm run of every round."""
    rates, rows = {}, []
    for key, runs in results.items():
        warm = [w for r in runs for w in r["warm"]]
        rates[key] = [w["steps"] / w["seconds"] for w in warm]
    median = {k: statistics.median(v) for k, v in rates.items()}
    for key, runs in results.items():
        warm = [w for r in runs for w in r["warm"]]
        steps = sum(w["steps"] for w in warm)
        rows.append({
            "benchmark": "training", "key": key, "name": ROWS[key],
            "steps_per_s": round(median[key], 1),
            "steps_per_s_min": round(min(rates[key]), 1),
            "steps_per_s_max": round(max(rates[key]), 1),
            "runs": len(warm),
            "ratio_vs_ours": round(median[key] / median["d"], 3) if "d" in median else None,
            "ratio_vs_ceiling": (round(median[key] / median["e"], 3)
                                 if "e" in median else None),
            "compiles_warmup": max(r["compiles_warmup"] for r in runs),
            "compiles_after_warmup": max(r["compiles_after_warmup"] for r in runs),
            "compiles_warm_runs": sum(w["n_compiles"] for w in warm),
            "d2h_per_step": round(sum(w["n_transfers_from_device"] for w in warm) / steps, 3),
            "executions_per_step": round(sum(w["n_executions"] for w in warm) / steps, 2),
            "cpu_ms_per_step": round(statistics.median(
                1e3 * w["cpu_seconds"] / w["steps"] for w in warm), 2),
            "host_ms_per_step": round(statistics.median(
                1e3 * w["host_seconds"] / w["steps"] for w in warm), 3),
            "fallbacks_per_step": round(sum(w["n_fallback_ops"] for w in warm) / steps, 3),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs)),
            "load_1min": [min(w.get("load", 0.0) for w in warm),
                          max(w.get("load", 0.0) for w in warm)],
            "steps_run": runs[0]["warm"][0]["steps"],
            "epochs": runs[0]["epochs"],
        })
    return rows


def run(quick: bool = False, rows: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every row, each in its own process, and return one dict per row.

    The row processes are started one after the other (each compiles in its cold run while
    the others wait), then stay alive, idle, while the parent asks each in turn for one
    warm run: rows a, b, ..., then the same backwards, and so on. Load from elsewhere on a
    shared machine therefore lands on every row alike. Quick: 2 epochs, 3 warm runs per
    row; full: 3 epochs, 7. Does not touch the XLA device of the calling process.
    """
    epochs, repeats = (2, 3) if quick else (3, 7)
    order = list(rows or ROWS)
    results: dict[str, dict[str, Any]] = {}
    children: dict[str, _Child] = {}
    with tempfile.TemporaryDirectory() as logs:
        try:
            for key in order:
                children[key] = _Child(key, epochs, logs)
                results[key] = {**children[key].receive(), "warm": []}
            for r in range(repeats):
                for key in (order if r % 2 == 0 else order[::-1]):
                    results[key]["warm"].append(children[key].request("run"))
                    results[key]["warm"][-1]["load"] = os.getloadavg()[0]  # others' jobs too
            for key in order:
                results[key].update(children[key].request("quit"))
        finally:
            for child in children.values():
                child.close()
    rows = summarise({key: [result] for key, result in results.items()})
    tick_us = watchdog_tick_us()  # issue 38: the hang watchdog's ticks, against ours' host time
    for row in rows:
        if row["key"] == "d":
            row["watchdog_us_per_step"] = round(2 * tick_us, 2)
            row["watchdog_share_of_host"] = round(2 * tick_us / 1e3 / row["host_ms_per_step"], 5)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    import pandas as pd

    frame = pd.DataFrame(rows).set_index("name")
    frame["spread"] = [f"{lo:g}-{hi:g}" for lo, hi in
                       zip(frame["steps_per_s_min"], frame["steps_per_s_max"], strict=True)]
    cols = {"steps_per_s": "steps/s", "spread": "min-max", "ratio_vs_ours": "vs (d)",
            "ratio_vs_ceiling": "vs (e)", "compiles_warmup": "compiles warm-up",
            "compiles_after_warmup": "compiles after", "d2h_per_step": "d2h/step",
            "executions_per_step": "executions/step", "cpu_ms_per_step": "CPU ms/step",
            "host_ms_per_step": "host ms/step",
            "peak_rss_mb": "peak RSS MB", "steps_run": "steps/run"}
    return frame[list(cols)].rename(columns=cols).to_string()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer epochs and repeats (CI)")
    ap.add_argument("--serve", choices=sorted(ROWS), help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--rows", help="comma-separated subset of rows: " + ",".join(ROWS))
    args = ap.parse_args(argv)
    if args.serve:  # one row in this fresh process, driven by run() over stdin/stdout
        _serve(args.serve, args.epochs)
        return 0
    quick = quick_mode(args.quick)
    start = time.perf_counter()
    rows = run(quick=quick, rows=args.rows.split(",") if args.rows else None)
    print(format_rows(rows))
    print(f"({time.perf_counter() - start:.0f} s; batch {GLOBAL_BATCH}; each row in its own "
          "process; XLA:CPU timings are inflated by other load on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
