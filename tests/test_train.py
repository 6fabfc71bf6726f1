"""Training: preemption (SIGKILL at a random step, resume, bit-identical weights), failures
reported by rank through real torch_xla.launch(fork), the script, the compile cache."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, run_python, run_script

from course.datasets import load_digits
from tpu_helpers.checkpoint import CheckpointDir, load_checkpoint
from tpu_helpers.compile_cache import compile_cache_dir, enable_compile_cache
from tpu_helpers.env import Runtime, layout_for
from tpu_helpers.train import Config, max_abs_diff

# 1,437 training images / global batch 128 = 11 steps per epoch: 16 steps cross an epoch
# end (evaluation, epoch checkpoint) and stop mid-epoch 2. Checkpoints every 3 steps.
STEPS = 16


def digits_npz(folder: Path) -> list[str]:
    """The shipped digits as the script's --data/--eval-data files (arrays x, y)."""
    for split in ("train", "test"):
        x, y = load_digits(split)
        np.savez(folder / f"digits-{split}.npz", x=x, y=y)
    return ["--data", str(folder / "digits-train.npz"),
            "--eval-data", str(folder / "digits-test.npz")]


def _train_cmd(out: Path, *extra: str, checkpoint_every: int = 3) -> list[str]:
    return [sys.executable, "-m", "tpu_helpers.train", "--out-dir", str(out),
            *digits_npz(out.parent), "--global-batch", "128", "--max-steps", str(STEPS),
            "--checkpoint-every", str(checkpoint_every), "--log-every", "4",
            "--progress", *extra]


def _popen(cmd: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _final(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "final.pt")["model"]


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_gives_bit_identical_weights(tmp_path):
    kill_at = random.Random().randint(4, STEPS - 1)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cache = tmp_path / "xla-cache"
    # The uninterrupted run and the run to be killed start together (2 cores). The
    # reference does not checkpoint mid-epoch at all: the schedule must not matter.
    ref = _popen(_train_cmd(whole, checkpoint_every=0))
    victim = _popen(_train_cmd(killed, "--compile-cache", str(cache)))
    seen = []
    try:
        for line in victim.stdout:
            seen.append(line.rstrip())
            if line.startswith(f"step {kill_at}/"):
                # Preemption takes the whole machine: kill the launcher AND the replica
                # process it forked (killing only the launcher leaves the replica running).
                os.killpg(victim.pid, signal.SIGKILL)
                break
        victim.wait(timeout=60)
        ref_out, _ = ref.communicate(timeout=600)
    finally:
        for p in (ref, victim):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert victim.returncode == -signal.SIGKILL, "\n".join(seen[-20:])
    assert ref.returncode == 0, ref_out[-3000:]
    assert not (killed / "final.pt").exists()
    saved = CheckpointDir(killed / "checkpoints").steps()
    assert saved and max(saved) <= kill_at, (saved, kill_at)

    # Resume: the same command again. It reads the cache the killed run wrote (on
    # XLA:CPU reading fails: PersistentCacheDeserializeFailure) and must not care.
    resumed = subprocess.run(_train_cmd(killed, "--compile-cache", str(cache)), cwd=REPO,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from step-{max(saved):08d}.pt" in resumed.stdout
    steps_run = [int(s.split()[1].split("/")[0]) for s in resumed.stdout.splitlines()
                 if s.startswith("step ")]
    assert steps_run == list(range(max(saved) + 1, STEPS + 1))

    a, b = _final(whole), _final(killed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs (killed at step {kill_at})"
    history = json.loads((killed / "history.json").read_text())
    assert history["total_steps"] == STEPS
    # the killed epoch is reported as the uninterrupted run reports it: all its steps in
    # the metrics, the same log steps and windows
    reference = json.loads((whole / "history.json").read_text())
    fields = ("epoch", "steps", "step", "train_loss", "train_acc", "eval_loss", "eval_acc")
    assert [{k: r[k] for k in fields} for r in history["epochs"]] == [
        {k: r[k] for k in fields} for r in reference["epochs"]]
    assert history["log"] == reference["log"], (kill_at, saved)
    counters = history["compile_cache"]
    assert counters.get("PersistentCacheDeserializeFailure", 0) + counters.get(
        "PersistentCacheHit", 0) > 0, counters


FAILURES = r"""
import ctypes, json, sys
from concurrent.futures.process import BrokenProcessPool
import torch, torch_xla
from tpu_helpers.train import ReplicaFailed, launch

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
from tpu_helpers.train import ReplicaFailed, launch


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
    from tpu_helpers.train import launch

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


@pytest.mark.parametrize("n", [1437, 1471, 2048])  # the digits; 23 x 64 - 1; fake data
def test_training_loaders_run_the_same_steps_on_the_same_samples_for_any_world_size(n):
    """A GLOBAL batch is not enough: 1, 2 and 8 replicas must also run the same number of
    optimizer steps, each on global_batch distinct samples (DistributedSampler pads by repeating
    samples, which can add a step: 1471 samples gave 23 steps on 8 replicas, 22 on 1)."""
    from torch.utils.data import TensorDataset

    from tpu_helpers.train import make_loaders

    x = torch.arange(n, dtype=torch.float32).reshape(n, 1, 1, 1)  # each sample: its index
    train_set = TensorDataset(x, torch.zeros(n, dtype=torch.int64))
    config = Config(global_batch=64)
    for world in (1, 2, 8):
        loaders = [make_loaders(train_set, None, config, world, r)[0] for r in range(world)]
        assert [len(loader) for loader in loaders] == [n // 64] * world, world
        steps = list(zip(*loaders, strict=True))  # one step: every replica's batch
        assert len(steps) == n // 64
        rows = [torch.cat([xb.flatten() for xb, _ in step]) for step in steps]
        assert {len(r) for r in rows} == {64}, world  # samples per optimizer step
        seen = torch.cat(rows)
        assert len(seen.unique()) == len(seen) == n // 64 * 64, world  # none repeated


def test_script_help_names_the_modes_and_who_writes():
    proc = subprocess.run([sys.executable, "-m", "tpu_helpers.train", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--spmd", "--storage", "--checkpoint-every", "--compile-cache",
                 "--max-steps", "global ordinal 0", "local ordinal 0"):
        assert flag in " ".join(proc.stdout.split()), flag


def test_config_rejects_bad_settings_before_anything_runs():
    with pytest.raises(ValueError, match="global_batch must be >= 1"):
        Config(global_batch=0)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        Config(optimizer="adam")
    with pytest.raises(ValueError, match="storage must be one of"):
        Config(storage="nfs")
    with pytest.raises(ValueError, match="differ in keys"):
        max_abs_diff({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def test_spmd_batch_must_split_over_the_devices():
    proc = run_python("""
        from tpu_helpers.env import configure_emulation
        configure_emulation(num_devices=4)
        from tpu_helpers.train import Config, train
        try:
            train(Config(spmd=True, global_batch=66))
        except ValueError as exc:
            print("ERROR", exc)
        """, timeout=300)
    assert "ERROR global_batch=66 does not split evenly over 4 devices" in proc.stdout


# --------------------------------------------------------------------------- compile cache


def test_compile_cache_dir_per_platform(tmp_path):
    from tpu_helpers.env import TORCH_XLA_VERSION as XLA  # the cache is per torch_xla release

    drive = tmp_path / "MyDrive"
    kaggle = tmp_path / "working"
    cpu = Runtime(platform="colab")
    loc = compile_cache_dir(cpu, environ={}, colab_drive=drive)
    assert not loc.persistent and str(loc.path).startswith("/content/xla-cache")
    assert "drive.mount" in loc.note
    drive.mkdir()
    loc = compile_cache_dir(cpu, environ={}, colab_drive=drive)
    assert loc.persistent and loc.path == drive / f"tpu-notebooks/xla-cache/torch_xla-{XLA}-cpu"
    tpu = Runtime(platform="kaggle", tpu_generation="v5e", chips=8,
                  accelerator_type="v5litepod-8", layout=layout_for("v5e", 8))
    loc = compile_cache_dir(tpu, environ={}, kaggle_working=kaggle)
    assert loc.path == kaggle / f"xla-cache/torch_xla-{XLA}-v5litepod-8" and loc.persistent
    loc = compile_cache_dir(Runtime(platform="tpu-vm", tpu_generation="v4", chips=4),
                            environ={}, home=tmp_path)
    assert loc.path == tmp_path / f".cache/tpu-notebooks/xla-cache/torch_xla-{XLA}-v4"
    loc = compile_cache_dir(Runtime(platform="local"), environ={"XDG_CACHE_HOME": "/xdg"})
    assert loc.path == Path(f"/xdg/tpu-notebooks/xla-cache/torch_xla-{XLA}-cpu")
    loc = compile_cache_dir(tpu, environ={"TPU_NB_COMPILE_CACHE": str(tmp_path / "mine")})
    assert loc.path == tmp_path / "mine"


def test_compile_cache_problems_warn_and_never_stop_the_run(tmp_path):
    import torch_xla

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="persistent compile cache not enabled"):
        assert enable_compile_cache(blocker / "cache") is None
    torch_xla.sync()
    (torch.ones(3, device=torch_xla.device()) * 2).cpu()  # something compiled here
    with pytest.warns(RuntimeWarning, match="already compiled"):
        assert enable_compile_cache(tmp_path / "late") is None
    assert (torch.ones(3, device=torch_xla.device()) * 3).sum().item() == 9.0
