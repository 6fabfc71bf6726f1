"""fit/train with the user's pieces: a Dataset, a loss, an optimizer and a schedule (resumed
bit for bit, no compile when the learning rate changes), a diverging loss stopped with the
step and the learning rate, a resume that runs 0 steps said out loud (the script's .npz
labels: tests/test_data_checks.py)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_script

SCRIPT = r'''
import json, sys, warnings
import torch, torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset
from course.datasets import load_digits
from course.models import DigitsCNN
from tpu_helpers.launch import ReplicaFailed
from tpu_helpers.train import Config, train

class Digits(Dataset):  # a map-style Dataset with a transform, not arrays
    def __init__(self, split):
        self.x, self.y = load_digits(split)
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]) * 2 - 1, int(self.y[i])

def log_softmax_model():
    return torch.nn.Sequential(DigitsCNN(), torch.nn.LogSoftmax(1))

def adadelta(params, config):
    return torch.optim.Adadelta(params, lr=config.lr)

def step_lr(optimizer, config):
    return StepLR(optimizer, step_size=1, gamma=0.5)

def run(out, **kw):
    config = Config(**{"global_batch": 128, "eval_global_batch": 100, "lr": 0.9,
                       "log_every": 4, "out_dir": out, **kw})
    return train(config, Digits("train"), log_softmax_model, eval_data=Digits("test"),
                 loss_fn=F.nll_loss, optimizer_fn=adadelta, scheduler_fn=step_lr)

mode, out = sys.argv[1], sys.argv[2]
if mode == "schedule":
    whole = run(out + "/whole", epochs=3)
    run(out + "/split", epochs=3, max_steps=15)  # stops in epoch 2 (11 steps an epoch)
    split = run(out + "/split", epochs=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = run(out + "/split", epochs=3)  # nothing left to do
    result = {"whole": whole, "split": split, "again": again,
              "warned": [str(w.message) for w in seen]}
elif mode == "per_step":  # scheduler.step() after every optimizer step, resumed mid-epoch
    def step_lr(optimizer, config):
        return StepLR(optimizer, step_size=5, gamma=0.8)
    whole = run(out + "/whole", epochs=2, scheduler_step="step")
    run(out + "/split", epochs=2, scheduler_step="step", max_steps=13)
    split = run(out + "/split", epochs=2, scheduler_step="step")
    result = {"whole": whole, "split": split}
elif mode == "diverge":
    try:
        run(out, epochs=1, lr=1e30)
        result = {"error": None}
    except ReplicaFailed as exc:
        result = {"error": [exc.rank, exc.summary]}
print("RESULT " + json.dumps(result))
'''


def _result(proc) -> dict:
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_schedule_resumes_bit_for_bit_compiles_once_and_a_finished_run_says_so(tmp_path):
    proc = run_script(tmp_path, "hooks.py", SCRIPT, "schedule", str(tmp_path), timeout=600)
    out = _result(proc)
    whole, split, again = out["whole"], out["split"], out["again"]
    assert [r["lr"] for r in whole["epochs"]] == [0.9, 0.45, 0.225]  # StepLR, per epoch
    assert [r["lr"] for r in split["epochs"]] == [0.9, 0.45, 0.225]  # its state resumed
    keys = ("epoch", "step", "lr", "train_loss", "train_acc", "eval_loss", "eval_acc")
    assert [{k: r[k] for k in keys} for r in split["epochs"]] == [
        {k: r[k] for k in keys} for r in whole["epochs"]]
    assert split["log"] == whole["log"]
    # the learning rate changes every epoch and nothing compiles after epoch 1
    assert whole["epochs"][0]["compiles"] > 0
    assert [r["compiles"] for r in whole["epochs"][1:]] == [0, 0], whole["epochs"]
    assert whole["epochs"][-1]["eval_acc"] > 0.85
    import torch

    from tpu_helpers.checkpoint import load_checkpoint
    a, b = (load_checkpoint(tmp_path / d / "final.pt")["model"] for d in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # train() again on the finished out_dir: 0 steps, said in the history, printed, warned
    assert again["runs"][-1]["steps"] == 0 and again["total_steps"] == 33
    assert again["note"].startswith("0 steps run: resumed at step 33, where epochs=3")
    assert again["note"] in proc.stdout and again["note"] in out["warned"]
    assert "note" not in whole and whole["runs"][-1]["steps"] == 33


@pytest.mark.slow
def test_a_per_step_schedule_resumes_mid_epoch_bit_for_bit_without_compiling(tmp_path):
    import torch

    from tpu_helpers.checkpoint import load_checkpoint

    out = _result(run_script(tmp_path, "hooks.py", SCRIPT, "per_step", str(tmp_path),
                             timeout=600))
    whole, split = out["whole"], out["split"]
    # 11 steps an epoch, StepLR(step_size=5) stepped per step: 0.9 * 0.8 ** (steps // 5)
    assert [r["lr"] for r in whole["epochs"]] == pytest.approx([0.9 * 0.8**2, 0.9 * 0.8**4])
    assert [r["lr"] for r in split["epochs"]] == [r["lr"] for r in whole["epochs"]]
    assert split["log"] == whole["log"]
    assert [r["compiles"] for r in whole["epochs"][1:]] == [0], whole["epochs"]
    a, b = (load_checkpoint(tmp_path / d / "final.pt")["model"] for d in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_diverging_loss_stops_the_run_naming_the_step_and_learning_rate(tmp_path):
    proc = run_script(tmp_path, "hooks.py", SCRIPT, "diverge", str(tmp_path / "run"),
                      timeout=600)
    rank, summary = _result(proc)["error"]
    assert rank == 0
    assert re.match(r"TrainingDiverged: the training loss is (nan|inf|-inf) at step ", summary)
    assert "(learning rate 1e+30)" in summary
    step = int(summary.split("at step ")[1].split()[0])
    assert step % 4 == 0  # found by the logging closure (log_every=4): no extra read
