"""launch: failures reported by rank through real torch_xla.launch(fork) processes (an
exception, a native crash, a SIGKILL, os._exit), and what cannot be pickled refused before any
process starts. Nothing here needs ``fit``: users launch their own loops with it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, run_script

from tpu_helpers.launch import launch

FAILURES = r"""
import ctypes, json, sys
from concurrent.futures.process import BrokenProcessPool
import torch, torch_xla
from tpu_helpers.launch import ReplicaFailed, launch

def load_batch(rank):
    x = torch.ones(4, device=torch_xla.device()).sum()  # real XLA work first
    torch_xla.sync()
    raise ValueError(f"bad record 17 in shard {rank}")

def raises(rank):
    load_batch(rank)

def crashes(rank):
    torch.ones(4, device=torch_xla.device()).sum().cpu()
    ctypes.string_at(0)  # a real segfault, as a bug in native code would cause

out = {}
for name, fn in (("raises", raises), ("crashes", crashes)):
    try:
        torch_xla.launch(fn, start_method="fork")
    except BaseException as exc:
        out["raw_" + name] = [type(exc).__name__, str(exc)]
    try:
        launch(fn)
    except ReplicaFailed as exc:
        out["wrapped_" + name] = [exc.rank, exc.summary, exc.details]
out["parent_runtime_started"] = bool(torch_xla._XLAC._xla_runtime_is_initialized())
print("RESULT " + json.dumps(out))
"""


def test_launch_failures_name_the_rank_and_keep_the_original_traceback(tmp_path):
    script = tmp_path / "failing_job.py"
    script.write_text(FAILURES)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    # Without the wrapper: the exception arrives, but nothing says which rank...
    assert out["raw_raises"] == ["ValueError", "bad record 17 in shard 0"]
    # ...and a crash without a Python exception is only a BrokenProcessPool.
    assert out["raw_crashes"][0] == "BrokenProcessPool"
    assert "rank" not in out["raw_crashes"][1]
    # With it: the rank, the exception and the full original traceback.
    rank, summary, details = out["wrapped_raises"]
    assert rank == 0 and summary == "ValueError: bad record 17 in shard 0"
    assert "in raises" in details and "in load_batch" in details
    assert 'failing_job.py", line' in details
    assert 'raise ValueError(f"bad record 17' in details  # source lines, as in the replica
    # A native crash: the rank and the Python stack faulthandler dumped at the crash.
    rank, summary, details = out["wrapped_crashes"]
    assert rank == 0 and "without a Python exception" in summary
    assert "Segmentation fault" in details and "in crashes" in details
    assert out["parent_runtime_started"] is False  # launch leaves the parent untouched


FOUR_REPLICAS = r"""
import ctypes, json, os, signal, sys, time
from pathlib import Path
import torch, torch_xla
import torch_xla.runtime as xr
from torch_xla.experimental import plugins
from tpu_helpers.launch import ReplicaFailed, launch


class FourChipHost(plugins.DevicePlugin):
    # torch_xla's run_multiprocess asks the device how many processes to start (on CPU:
    # always 1). Answer as a 4-chip TPU host's topology does: 4 processes, one replica
    # each, with its own ordinal. The pool, fork, pickling and SIGTERMs stay torch_xla's.
    def physical_chip_count(self):
        return 4

    def configure_multiprocess(self, local_rank, local_world_size):
        xr._WORLD_SIZE, xr._ORDINAL = local_world_size, local_rank


plugins.using_dynamic_plugins = lambda: True
plugins.default = FourChipHost


def replica(rank, how, ready):
    Path(ready, str(rank)).write_text(f"{os.getpid()} {xr.world_size()}")
    if rank == 2:
        while how.endswith("after") and len(os.listdir(ready)) < 4:
            time.sleep(0.01)  # crash once the other replicas run
        if how.startswith("segv"):
            ctypes.string_at(0)
        if how.startswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    while True:  # real XLA work (native code) until the pool stops this replica
        torch.ones(4, device=torch_xla.device()).sum().item()


out = []
for i, how in enumerate(sys.argv[1:]):
    ready = Path(f"ready-{i}")
    ready.mkdir()
    try:
        launch(replica, args=(how, str(ready)))
    except ReplicaFailed as exc:
        seen = sorted((int(p.name), *map(int, p.read_text().split())) for p in ready.iterdir())
        out.append([how, exc.rank, exc.summary, exc.details, seen])
print("RESULT " + json.dumps(out))
"""


def test_launch_names_the_rank_that_crashed_among_four_real_processes(tmp_path):
    """Rank 2 of 4 real replica processes dies (segfault, SIGKILL, os._exit), before or after
    the others started; the pool then SIGTERMs the others. Rank 2 is named every time."""
    runs = ["segv_after"] * 4 + ["segv_now"] * 3 + ["kill_after"] * 3 + ["exit_after"] * 2
    proc = run_script(tmp_path, "four_replicas.py", FOUR_REPLICAS, *runs, timeout=400)
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert [r[0] for r in out] == runs  # every run raised ReplicaFailed
    for how, rank, summary, details, seen in out:
        if how.endswith("after"):  # four real processes, ranks 0-3, world size 4
            assert [(r, w) for r, _, w in seen] == [(0, 4), (1, 4), (2, 4), (3, 4)], seen
            assert len({pid for _, pid, _ in seen}) == 4, seen
        assert rank == 2, (how, rank, summary, seen)
        assert "without a Python exception" in summary
        if how.startswith("segv"):
            assert "Segmentation fault" in details and "in replica" in details, details
        else:
            assert "without a stack dump" in summary, summary


def test_launch_refuses_what_it_cannot_pickle_before_starting_anything():
    """torch_xla.launch pickles fn and args even with fork: a nested function or a lambda
    gets a clear error on the host, naming the object, instead of "Can't pickle local
    object" from the process pool."""

    def nested(rank: int) -> None:
        pass

    data = (np.zeros((1000, 64), np.float32), torch.zeros(3))
    for fn, args, where in ((nested, (), "fn "), (print, (data, {"f": lambda x: x}),
                                                   "args[1]['f'] ")):
        with pytest.raises(TypeError) as info:
            launch(fn, args=args)
        message = " ".join(str(info.value).split())
        assert message.startswith(f"launch cannot send {where}"), message
        assert "even with start_method='fork'" in message
        assert "define the function at module level" in message
        assert "pass data through `args`" in message
