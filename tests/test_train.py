"""Training: preemption (SIGKILL at a random step, resume, bit-identical weights), the script.
Failures reported by rank: tests/test_launch.py; the compile cache: tests/test_compile_cache.py."""

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
from conftest import REPO, run_python, stop_after_line

from course.datasets import load_digits
from course.models import max_abs_diff
from tpu_helpers.checkpoint import CheckpointDir, load_checkpoint
from tpu_helpers.train import Config

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
    # the replica stops itself at the line the test kills it at: no step after it runs
    victim = _popen([*stop_after_line(f"step {kill_at}/"),
                     *_train_cmd(killed, "--compile-cache", str(cache))[1:]])
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
    # exactly: the last one before step kill_at (every 3 steps and the epoch's end, step
    # 11); step kill_at's own is written after its line
    assert max(saved) == max(s for s in range(kill_at) if s % 3 == 0 or s == 11), saved

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
