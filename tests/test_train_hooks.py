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
import json, sys, traceback, warnings
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

def step_lr_every_5(optimizer, config):  # for scheduler_step="step"
    return StepLR(optimizer, step_size=5, gamma=0.8)

def run(out, scheduler_fn=step_lr, **kw):
    config = Config(**{"global_batch": 128, "eval_global_batch": 100, "lr": 0.9,
                       "log_every": 4, "out_dir": out, **kw})
    return train(config, Digits("train"), log_softmax_model, eval_data=Digits("test"),
                 loss_fn=F.nll_loss, optimizer_fn=adadelta, scheduler_fn=scheduler_fn)

def schedule(out):
    whole = run(out + "/whole", epochs=3)
    run(out + "/split", epochs=3, max_steps=15)  # stops in epoch 2 (11 steps an epoch)
    split = run(out + "/split", epochs=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = run(out + "/split", epochs=3)  # nothing left to do
    return {"whole": whole, "split": split, "again": again,
            "warned": [str(w.message) for w in seen]}

def per_step(out):  # scheduler.step() after every optimizer step, resumed mid-epoch
    kw = {"epochs": 2, "scheduler_step": "step", "scheduler_fn": step_lr_every_5}
    whole = run(out + "/whole", **kw)
    run(out + "/split", max_steps=13, **kw)
    split = run(out + "/split", **kw)
    return {"whole": whole, "split": split}

def diverge(out):
    try:
        run(out, epochs=1, lr=1e30)
        return {"error": None}
    except ReplicaFailed as exc:
        return {"error": [exc.rank, exc.summary]}

# one process for every case the session selected (each run forks its own replica)
for mode in sys.argv[2:]:
    try:
        result = globals()[mode](sys.argv[1] + "/" + mode)
    except Exception:  # reported to this case's test only
        result = {"crashed": traceback.format_exc()}
    print(f"RESULT {mode} " + json.dumps(result), flush=True)
'''


MODES = {"test_schedule_resumes_bit_for_bit_compiles_once_and_a_finished_run_says_so":
         "schedule",
         "test_a_per_step_schedule_resumes_mid_epoch_bit_for_bit_without_compiling": "per_step",
         "test_a_diverging_loss_stops_the_run_naming_the_step_and_learning_rate": "diverge"}


@pytest.fixture(scope="module")
def hooks(request, tmp_path_factory):
    """One script run for the cases this session selected (one torch_xla import, not three):
    (its process, its folder, mode -> result)."""
    selected = {i.originalname for i in request.session.items  # notebooks have no module
                if getattr(i, "module", None) is request.module}
    modes = [m for name, m in MODES.items() if name in selected]
    folder = tmp_path_factory.mktemp("hooks")
    proc = run_script(folder, "hooks.py", SCRIPT, str(folder), *modes, timeout=900)
    results = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
               for line in proc.stdout.splitlines() if line.startswith("RESULT ")}
    assert sorted(results) == sorted(modes), proc.stdout[-3000:]
    return proc, folder, results


def result(hooks, mode: str) -> dict:
    out = hooks[2][mode]
    assert "crashed" not in out, out.get("crashed")
    return out


@pytest.mark.slow
def test_schedule_resumes_bit_for_bit_compiles_once_and_a_finished_run_says_so(hooks):
    proc, folder, _ = hooks
    out = result(hooks, "schedule")
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
    a, b = (load_checkpoint(folder / "schedule" / d / "final.pt")["model"]
            for d in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # train() again on the finished out_dir: 0 steps, said in the history, printed, warned
    assert again["runs"][-1]["steps"] == 0 and again["total_steps"] == 33
    assert again["note"].startswith("0 steps run: resumed at step 33, where epochs=3")
    assert again["note"] in proc.stdout and again["note"] in out["warned"]
    assert "note" not in whole and whole["runs"][-1]["steps"] == 33


@pytest.mark.slow
def test_a_per_step_schedule_resumes_mid_epoch_bit_for_bit_without_compiling(hooks):
    import torch

    from tpu_helpers.checkpoint import load_checkpoint

    folder, out = hooks[1], result(hooks, "per_step")
    whole, split = out["whole"], out["split"]
    # 11 steps an epoch, StepLR(step_size=5) stepped per step: 0.9 * 0.8 ** (steps // 5)
    assert [r["lr"] for r in whole["epochs"]] == pytest.approx([0.9 * 0.8**2, 0.9 * 0.8**4])
    assert [r["lr"] for r in split["epochs"]] == [r["lr"] for r in whole["epochs"]]
    assert split["log"] == whole["log"]
    assert [r["compiles"] for r in whole["epochs"][1:]] == [0], whole["epochs"]
    a, b = (load_checkpoint(folder / "per_step" / d / "final.pt")["model"]
            for d in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_diverging_loss_stops_the_run_naming_the_step_and_learning_rate(hooks):
    rank, summary = result(hooks, "diverge")["error"]
    assert rank == 0
    assert re.match(r"TrainingDiverged: the training loss is (nan|inf|-inf) at step ", summary)
    assert "(learning rate 1e+30)" in summary
    step = int(summary.split("at step ")[1].split()[0])
    assert step % 4 == 0  # found by the logging closure (log_every=4): no extra read
