"""Resuming: a checkpoint remembers the run settings its step counter depends on, refuses a
resume with other ones (naming the checkpoint and both values), offers an explicit new
epoch with new settings, and a mid-epoch resume reports the epoch as an uninterrupted run
does (the same metrics and log points in history.json). The SIGKILL case is in
tests/test_train.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import zygote
from conftest import REPO
from test_train import digits_npz

from course.models import DigitsCNN
from tpu_helpers.checkpoint import CheckpointDir, load_checkpoint
from tpu_helpers.train import Config, ResumeMismatch, resume_from

METRICS = ("epoch", "steps", "step", "train_loss", "train_acc", "eval_loss", "eval_acc",
           "eval_count")


def train(out: Path, *args: str, check: bool = True,
          devices: int = 1) -> subprocess.CompletedProcess[str]:
    cmd = ["-m", "tpu_helpers.train", "--out-dir", str(out), "--log-every", "4",
           *digits_npz(out.parent), *args]
    env = {**os.environ, "CPU_NUM_DEVICES": str(devices)}  # XLA:CPU devices (for --spmd)
    proc = zygote.run(cmd, cwd=REPO, env=env, timeout=600)  # python -m (tests/zygote.py)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def metrics(history: dict) -> list[dict]:
    return [{k: row[k] for k in METRICS} for row in history["epochs"]]


def history(out: Path) -> dict:
    return json.loads((out / "history.json").read_text())


@pytest.mark.slow
def test_resume_refuses_other_settings_then_matches_an_uninterrupted_run(tmp_path):
    # 1,437 images / batch 128 = 11 steps an epoch; stop at 7 (between log points 4 and 8)
    whole, split, other = tmp_path / "whole", tmp_path / "split", tmp_path / "other"
    train(whole, "--global-batch", "128", "--epochs", "2")
    train(split, "--global-batch", "128", "--epochs", "2", "--max-steps", "7")
    ckpt = "step-00000007.pt"
    assert CheckpointDir(split / "checkpoints").steps() == [7]
    shutil.copytree(split, other)
    stopped = history(split)
    # every setting the step counter depends on, checked on the real checkpoint
    saved = load_checkpoint(split / "checkpoints" / ckpt)
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters())
    config = Config(global_batch=128)
    settings = saved["extra"]["settings"]
    assert settings == {"mode": "launch", "world_size": 1, "devices": 1, "global_batch": 128,
                        "seed": 0, "train_samples": 1437, "steps_per_epoch": 11}
    for key, value in (("devices", 4), ("world_size", 8), ("train_samples", 1000), ("seed", 1),
                       ("steps_per_epoch", 5), ("mode", "spmd")):
        with pytest.raises(ResumeMismatch, match=f"{ckpt}: written with other run settings "
                                                 f"\\({key}=.* in the checkpoint, .* now\\)"):
            resume_from(saved, split / "checkpoints" / ckpt, config, {**settings, key: value},
                        model, optimizer)
    # and through the script, as a user meets it
    for args, devices, expected in (
        (["--global-batch", "64"], 1, ["global_batch=128 in the checkpoint, 64 now"]),
        (["--global-batch", "128", "--spmd"], 2,
         ["mode='launch' in the checkpoint, 'spmd' now",
          "devices=1 in the checkpoint, 2 now"]),
    ):
        proc = train(split, "--epochs", "2", *args, check=False, devices=devices)
        assert proc.returncode != 0
        err = " ".join(proc.stderr.split())
        assert f"{ckpt}: written with other run settings" in err, err[-2000:]
        for words in expected:
            assert words in err, (words, err[-2000:])
        assert "--resume-new-settings" in err
        assert CheckpointDir(split / "checkpoints").steps() == [7]  # nothing was changed
        assert history(split) == stopped

    # the same settings: the interrupted epoch is reported as the uninterrupted run does
    resumed = train(split, "--global-batch", "128", "--epochs", "2")
    assert f"resumed from {ckpt}" in resumed.stdout
    a, b = history(whole), history(split)
    assert metrics(b) == metrics(a)  # the resumed epoch counts all 11 steps, not 4
    assert b["log"] == a["log"]  # the same log steps and windows, 4 8 | 15 19
    assert [r["step"] for r in b["log"]] == [4, 8, 15, 19]
    final_a, final_b = (load_checkpoint(p / "final.pt")["model"] for p in (whole, split))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    assert [r["from_step"] for r in b["runs"]] == [0, 7]

    # new settings on request: its weights and optimizer, a new epoch with batch 64
    before = load_checkpoint(other / "checkpoints" / ckpt)["model"]
    train(other, "--global-batch", "64", "--epochs", "2", "--resume-new-settings")
    h = history(other)
    assert h["global_batch"] == 64 and h["config"]["global_batch"] == 64
    assert h["steps_per_epoch"] == 22  # 1,437 / 64
    assert h["runs"][-1] == {"from_step": 7, "checkpoint": ckpt, "new_settings": True,
                             "steps": 22,
                             "settings": {**h["runs"][0]["settings"], "global_batch": 64,
                                          "steps_per_epoch": 22}}
    # the stopped epoch 1 is not finished: training went on with epoch 2
    assert [row["epoch"] for row in h["epochs"]] == [2]
    assert h["total_steps"] == 7 + 22
    after = load_checkpoint(other / "final.pt")["model"]
    assert any(not torch.equal(before[k], after[k]) for k in before)
