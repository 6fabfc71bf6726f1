"""Notebook 03 writes the training loop in cells and runs it once; this test is where the
loop is proven equal to :func:`tpu_helpers.train.fit`, so the notebook does not train twice.

The cells marked ``#@save tpu_helpers/train.py`` (``train_step``, ``step_seed``,
``train_epoch``) equal the module's functions (``test_cells_match_toolkit.py``); the loader is
``tpu_helpers.data.make_train_loader`` (notebook 01's loader, checked), as in ``fit``.
Here the notebook's per-replica loop, built from them as the notebook builds it, trains on the
digits, and ``fit`` trains on the same data and settings: the same weights bit for bit and the
same logged losses at every logged step, on XLA:CPU."""

from __future__ import annotations

import json

import pytest
from conftest import run_python

LOOP_VS_FIT = r'''
import json, sys
import torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
from torch.utils.data import TensorDataset
from course.datasets import load_digits
from course.models import DigitsCNN
from tpu_helpers.checkpoint import load_checkpoint
from tpu_helpers.data import make_train_loader
from tpu_helpers.train import Config, fit, train_epoch

EPOCHS, GLOBAL_BATCH, LR, WD, SEED, LOG_EVERY, out = 2, 64, 3e-3, 1e-2, 0, 5, sys.argv[1]
DIGITS = (*load_digits("train"), *load_digits("test"))
device = torch_xla.device()

# notebook 03's per-replica function (world size 1, rank 0)
loader = make_train_loader(TensorDataset(torch.from_numpy(DIGITS[0]), torch.from_numpy(DIGITS[1])),
                           GLOBAL_BATCH, world_size=1, rank=0, seed=SEED)
torch.manual_seed(SEED)
model = DigitsCNN().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
log = []

def after_step(step, totals):  # logs as fit does: every LOG_EVERY batches of an epoch
    if ((step - 1) % len(loader) + 1) % LOG_EVERY == 0:
        xm.add_step_closure(lambda: log.append([step, *totals.tolist()]))
    return False

for epoch in range(EPOCHS):
    loader.sampler.set_epoch(epoch)
    train_epoch(model, optimizer, pl.MpDeviceLoader(loader, device), epoch * len(loader),
                after_step, seed=SEED, rank=0)
torch_xla.sync()
mine = {k: v.cpu() for k, v in model.state_dict().items()}

history = fit(Config(epochs=EPOCHS, global_batch=GLOBAL_BATCH, lr=LR, weight_decay=WD, seed=SEED,
                     log_every=LOG_EVERY, out_dir=out), DIGITS, DigitsCNN)
theirs = load_checkpoint(out + "/final.pt")["model"]
print("RESULT " + json.dumps({
    "keys": sorted(mine) == sorted(theirs),
    "equal": [k for k in theirs if torch.equal(mine[k], theirs[k])], "tensors": len(theirs),
    "mine": [[s, loss / n] for s, loss, _, n in log],
    "fit": [[r["step"], r["loss"]] for r in history["log"]],
    "steps": history["total_steps"], "acc": history["epochs"][-1]["eval_acc"]}))
'''


@pytest.mark.slow
def test_the_notebooks_loop_and_fit_train_the_same_weights_bit_for_bit(tmp_path):
    proc = run_python(LOOP_VS_FIT.replace("sys.argv[1]", repr(str(tmp_path / "fit"))))
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    assert r["keys"] and len(r["equal"]) == r["tensors"], r["equal"]  # every tensor, bit for bit
    assert r["steps"] == 2 * (1437 // 64) and len(r["mine"]) == 2 * (1437 // 64 // 5)
    assert r["mine"] == r["fit"]  # the same loss at every logged step
    assert r["acc"] > 0.8
