"""The README's "Port your own script" on a GPU-style script of our own (examples/port):
both ports reach the original's accuracy (the original on plain CPU PyTorch), and the
toolkit port resumes after SIGKILL bit for bit, schedule included, compiling nothing after
its first epoch."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, stop_after_line

from tpu_helpers.checkpoint import CheckpointDir, load_checkpoint

PORT = REPO / "examples" / "port"
EPOCHS = 4  # 22 steps an epoch (1,437 images, batch 64): lr 1.0, 0.7, 0.49, 0.343


def _popen(script: str, *args: str, xla: bool = True,
           python: list[str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if not xla:  # the original, as its author runs it: plain PyTorch, no torch_xla
        env.pop("PJRT_DEVICE", None)
    cmd = [*(python or [sys.executable]), str(PORT / script), "--epochs", str(EPOCHS), *args]
    return subprocess.Popen(cmd, cwd=PORT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _accuracy(out: str) -> float:
    """The last "Accuracy: c/n" line every version prints."""
    correct, n = re.findall(r"Accuracy: (\d+)/(\d+)", out)[-1]
    return int(correct) / int(n)


def _finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_both_ports_match_the_original_and_the_toolkit_port_resumes_bit_for_bit(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    kill_at = random.Random().randint(25, 4 * 22 - 5)  # after the first StepLR step
    toolkit = ("--checkpoint-every", "5", "--progress")
    procs = [_popen("original.py", xla=False), _popen("port_minimal.py"),
             _popen("port_toolkit.py", "--out-dir", str(whole), *toolkit)]
    # the replica stops itself at the line the test kills it at: no step after it runs
    victim = _popen("port_toolkit.py", "--out-dir", str(killed), *toolkit,
                    python=stop_after_line(f"step {kill_at}/"))
    try:
        for line in victim.stdout:
            if line.startswith(f"step {kill_at}/"):
                os.killpg(victim.pid, signal.SIGKILL)  # the launcher and its replica
                break
        victim.wait(timeout=60)
        original, minimal, uninterrupted = (_finish(p) for p in procs)
    finally:
        for p in [*procs, victim]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert victim.returncode == -signal.SIGKILL
    saved = CheckpointDir(killed / "checkpoints").steps()
    assert saved and max(saved) <= kill_at, (saved, kill_at)
    # exactly: the last one before step kill_at (every 5 steps and each epoch's end, 22
    # steps); step kill_at's own is written after its line
    assert max(saved) == max(s for s in range(kill_at) if s % 5 == 0 or s % 22 == 0), saved
    resumed = _finish(_popen("port_toolkit.py", "--out-dir", str(killed), *toolkit))

    # accuracy: the original on CPU PyTorch, both ports on XLA:CPU
    reference = _accuracy(original)
    print(f"accuracy: original {reference:.4f}, minimal port {_accuracy(minimal):.4f}, "
          f"toolkit port {_accuracy(uninterrupted):.4f} (killed at step {kill_at})")
    assert reference > 0.85
    for out in (minimal, uninterrupted, resumed):
        assert _accuracy(out) >= reference - 0.03, out[-1500:]
    # kill and resume: the same weights, schedule and metrics as the uninterrupted run
    a, b = (load_checkpoint(d / "final.pt")["model"] for d in (whole, killed))
    assert all(torch.equal(a[k], b[k]) for k in a), kill_at
    h_whole, h_killed = (json.loads((d / "history.json").read_text()) for d in (whole, killed))
    keys = ("epoch", "step", "lr", "train_loss", "train_acc", "eval_loss", "eval_acc")
    assert [r["from_step"] for r in h_killed["runs"]] == [0, max(saved)]
    assert [{k: r[k] for k in keys} for r in h_killed["epochs"]] == [
        {k: r[k] for k in keys} for r in h_whole["epochs"]]
    assert [round(r["lr"], 6) for r in h_whole["epochs"]] == [1.0, 0.7, 0.49, 0.343]
    # one compile for the step (and evaluation) in epoch 1, none after: the schedule too
    assert h_whole["epochs"][0]["compiles"] > 0
    assert [r["compiles"] for r in h_whole["epochs"][1:]] == [0] * (EPOCHS - 1)
