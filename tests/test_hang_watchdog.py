"""tpu_helpers.hang_watchdog with real processes: gloo ranks (XLA:CPU has no cross-process XLA
collectives) that hang the ways replicas hang on a TPU: one rank with one batch more than the
others, a collective called on one rank only, a loader worker that never returns. The monitor
names the rank, its step and phase and the line it waits in, within twice the timeout; a long
first step (a compile) and a healthy 8-rank run raise no alarm."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
from conftest import REPO, forked_ranks

from tpu_helpers.hang_watchdog import Monitor

# Issue 38: on both torch_xla lines (the monitor reads torch_xla's compile counter, launch and
# train start the replicas through torch_xla.launch).
pytestmark = pytest.mark.both_lines

STEPS = 12
WORKER = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from tpu_helpers import hang_watchdog as watchdog

rank, world, folder, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "init"),
                        rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
watchdog.start_replica(folder, rank, sample_every=None)


class Rows(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        if case == "data" and rank == 1 and i == 8:
            time.sleep(10**6)  # a loader worker that never returns a batch
        return torch.ones(2)


batches = iter(DataLoader(Rows(), batch_size=1, num_workers=1 if case == "data" else 0))
steps = {"uneven": 12 + (rank == 0)}.get(case, 12)  # rank 0: one batch more
for step in range(1, steps + 1):
    watchdog.tick(step - 1, "data")
    x = next(batches)
    watchdog.tick(step, "step")
    time.sleep(4.0 if case == "compile" and step == 1 else 0.05)  # the first step's compile
    dist.all_reduce(x)  # ALL_REDUCE
    if case == "rendezvous" and rank == 0 and step == 8:
        dist.barrier()  # RANK_CONDITIONAL
watchdog.tick(steps, "collective")
dist.barrier()  # END_OF_RUN
watchdog.tick(steps, "done")
"""
LINE = {name: 1 + next(i for i, line in enumerate(WORKER.split("\n")) if f"# {name}" in line)
        for name in ("ALL_REDUCE", "RANK_CONDITIONAL", "END_OF_RUN")}


def watched(case: str, world: int, folder, **monitor_args) -> tuple[str | None, float, float]:
    """Run ``world`` ranks of WORKER; poll a monitor until it fires (then stop the ranks) or
    they finish. Returns the report, the seconds from the last progress to the alarm, and
    the timeout."""
    monitor = Monitor(folder, world, **monitor_args)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            forked_ranks(WORKER, [[str(r), str(world), str(folder), case] for r in range(world)],
                         folder / "rank-", _env(), 300)
        except BaseException as exc:  # the killed ranks fail forked_ranks: expected then
            failed.append(exc)

    ranks = threading.Thread(target=run)
    ranks.start()
    report, late = None, 0.0
    while ranks.is_alive() and report is None:
        time.sleep(0.2)
        report = monitor.poll()
    if report is not None:
        late = time.monotonic() - max(s.since for s in monitor.seen.values())
        monitor.stop_replicas()
    ranks.join(60)
    if report is None:
        assert not failed, failed
    return report, late, monitor.limit()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _row(report: str, rank: int) -> str:
    return next(line for line in report.splitlines() if re.match(rf"\s+{rank}\s+-?\d+\s", line))


@pytest.mark.slow
def test_one_rank_with_one_batch_more_is_named_with_its_line(tmp_path):
    report, late, limit = watched("uneven", 3, tmp_path, min_timeout=1.5, factor=20)
    print(report, f"\nalarm {late:.1f} s after the last progress (timeout {limit:.1f} s)")
    assert report is not None and late <= 2 * limit
    assert f"ahead: replica(s) 0 at step {STEPS + 1}" in report
    assert f"<worker>:{LINE['ALL_REDUCE']} in <module>" in _row(report, 0)
    assert f"<worker>:{LINE['END_OF_RUN']} in <module>" in _row(report, 1)


@pytest.mark.slow
def test_a_collective_on_one_rank_only_is_named(tmp_path):
    report, late, limit = watched("rendezvous", 3, tmp_path, min_timeout=1.5, factor=20)
    print(report)
    assert report is not None and late <= 2 * limit
    assert "behind: replica(s) 0 at step 8" in report
    assert f"<worker>:{LINE['RANK_CONDITIONAL']} in <module>" in _row(report, 0)


@pytest.mark.slow
def test_a_loader_worker_that_never_returns_is_named_as_data(tmp_path):
    report, late, limit = watched("data", 2, tmp_path, min_timeout=1.5, factor=20)
    print(report)
    assert report is not None and late <= 2 * limit
    assert re.search(r"^\s+1\s+8\s+data\s", _row(report, 1))


@pytest.mark.slow
def test_a_healthy_run_of_eight_ranks_with_a_long_first_step_is_not_an_alarm(tmp_path):
    """The first step takes 4 s (a compile on a TPU can take minutes), longer than the 2.5 s
    timeout: the monitor is not armed before the warm-up steps are done."""
    report, _, limit = watched("compile", 8, tmp_path, min_timeout=2.5, factor=20)
    assert report is None and limit < 4.0


LAUNCHED = """
import time
import torch, torch_xla
from tpu_helpers import hang_watchdog
from tpu_helpers.launch import launch


def loop(rank):  # a user's own loop: one tick per step, nothing else
    for step in range(1, 40):
        hang_watchdog.tick(step - 1, "data")
        if step == 6:
            time.sleep(10**6)  # the next batch never comes
        keep = torch.ones(4, device=torch_xla.device()) * step
        hang_watchdog.tick(step, "step")
        torch_xla.sync()


started = time.monotonic()
try:
    launch(loop, watchdog={"min_timeout": 1.0, "poll": 0.2})
except hang_watchdog.ReplicaHung as exc:
    print(f"HUNG after {time.monotonic() - started:.1f} s", exc, sep="\\n")
"""


def test_launch_with_a_watchdog_names_and_stops_a_hung_replica():
    """tpu_helpers.launch runs the monitor; the replica's first tick opens its slot (the
    folder comes through the environment), and the hang ends as ReplicaHung."""
    from conftest import run_python

    out = run_python(LAUNCHED, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}).stdout
    print(out)
    assert "HUNG after" in out
    assert re.search(r"^\s+0\s+5\s+data\s+\S+\s+<string>:\d+ in loop", out, re.M), out


TRAINED = """
import sys, time
import torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
from tpu_helpers import hang_watchdog
from tpu_helpers.train import Config, train


class Rows(TensorDataset):  # the user's data: a row of the 20th batch fetched never comes back
    calls = 0

    def __getitem__(self, i):
        Rows.calls += 1
        if sys.argv[1] == "data" and Rows.calls == 19 * 32 + 1:
            time.sleep(10**6)  # ROW_STALLS
        return super().__getitem__(i)


def loss(output, y):  # the user's loss: the 7th call never returns (case "step")
    loss.calls = getattr(loss, "calls", 0) + 1
    if sys.argv[1] == "step" and loss.calls == 7:
        time.sleep(10**6)  # LOSS_STALLS
    return F.cross_entropy(output, y)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    rows = Rows(torch.randn(1024, 1, 8, 8, generator=g), torch.randint(0, 10, (1024,), generator=g))
    started = time.monotonic()
    try:
        train(Config(epochs=1, global_batch=32, watchdog=1.0, log_every=100), rows, loss_fn=loss)
    except hang_watchdog.ReplicaHung as exc:
        print(f"HUNG after {time.monotonic() - started:.1f} s", exc, sep="\\n")
"""


@pytest.mark.parametrize("case", ["step", "data"])
def test_train_ticks_the_watchdog_so_a_stalled_replica_is_named(tmp_path, case):
    """train() runs the monitor and fit ticks it: no change to the user's code. A loss that
    never returns is named in phase "step" at its line; a row the loader never returns, in
    phase "data" (the loader's worker thread: MpDeviceLoader's). A replica that never gets
    its first batches never ticks: before warm-up nothing is judged (a compile can take minutes)."""
    from conftest import run_script

    proc = run_script(tmp_path, "trained.py", TRAINED, case, timeout=300)
    out = proc.stdout
    print(out)
    assert "HUNG after" in out, proc.stderr[-3000:]
    row = _row(out, 0)
    if case == "step":
        assert re.match(r"\s+0\s+6\s+step\s", row), row
        line = 1 + next(i for i, t in enumerate(TRAINED.split("\n")) if "# LOSS_STALLS" in t)
        assert f"trained.py:{line} in loss" in row, row
    else:
        # MpDeviceLoader's thread sends batches to the device 8 at a time (device_prefetch_size;
        # _get_batch in parallel_loader.py at v2.8.0/v2.9.0): the loop waits a few batches early
        step = int(re.match(r"\s+0\s+(\d+)\s+data\s", row).group(1))
        assert 3 <= step < 19, row
