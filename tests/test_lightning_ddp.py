"""Notebook 06's multi-process shapes with real processes: Lightning DDP, 2 CPU processes, gloo.

On a multi-device TPU (8 on a v5e-8) ``Trainer(accelerator="tpu", devices="auto")`` forks one
process per device with ``_XLALauncher``, a ``_MultiProcessingLauncher``. XLA:CPU cannot run a
multi-process XLA strategy, so the same launcher runs here with ``strategy="ddp_fork"`` (fork,
like XLAStrategy) on the CPU with gloo. What notebook 06 relies on, checked with real processes:

* callback state lives in each rank's process: the notebook's own callback object stays empty,
  every rank writes its counts (:func:`course.lightning_demo.read_counts`);
* rank 0 saves the checkpoint through ``AtomicXLACheckpointIO`` (atomic, loads safely) and the
  launching process gets the best path and rank 0's weights back;
* ``trainer.predict`` returns ``None``; the writer's rank files and merged result hold every
  prediction exactly once, in dataset order, equal to a plain forward pass;
* the guarded re-fit: the same Trainer refuses a second ``fit``; a new Trainer resumes from
  the checkpoint (the launching process's loop counters stay 0: read the ranks' records).
"""

from __future__ import annotations

import json

import pytest
from conftest import run_script

SCRIPT = r'''
import json, sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from course.datasets import load_digits
from course.lightning_demo import DigitsLightningModule, XLACountsCallback, read_counts
from tpu_helpers.data import ArrayDataset
from tpu_helpers.tpu_lightning import (AtomicXLACheckpointIO, ExactlyOncePredictionWriter,
                                   read_predictions)


def trainer(out, **kwargs):
    return L.Trainer(accelerator="cpu", devices=2, plugins=[AtomicXLACheckpointIO()],
                     strategy=DDPStrategy(start_method="fork", process_group_backend="gloo"),
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=out, limit_train_batches=4, limit_val_batches=2,
                     **kwargs)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    train = ArrayDataset(*load_digits("train"))
    test = ArrayDataset(*load_digits("test"))
    train_loader = DataLoader(train, batch_size=32, shuffle=True, drop_last=True)
    val_loader = DataLoader(test, batch_size=60)
    report = {}

    torch.manual_seed(0)
    model = DigitsLightningModule(lr=5e-3)
    before = [p.detach().clone() for p in model.parameters()]
    counts = XLACountsCallback(out / "counts")
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_acc", mode="max")
    fit = trainer(out, max_epochs=2, callbacks=[counts, checkpoint])
    fit.fit(model, train_loader, val_loader)
    ranks = read_counts(out / "counts")
    report["fit"] = {
        "parent_epochs": len(counts.epochs),
        "ranks": {r: {"steps": [e["steps"] for e in c.epochs],
                      "reduce_calls": [e["reduce_calls"] for e in c.epochs]}
                  for r, c in ranks.items()},
        "best": checkpoint.best_model_path,
        "weights_came_back": any(not torch.equal(a, b)
                                 for a, b in zip(before, model.parameters())),
        "ckpt_files": sorted(p.name for p in (out / "ckpt").iterdir()),
    }
    state = AtomicXLACheckpointIO().load_checkpoint(checkpoint.best_model_path)
    report["fit"]["ckpt_epoch"] = state["epoch"]

    writer = ExactlyOncePredictionWriter(out / "predictions")
    returned = trainer(out, callbacks=[writer]).predict(model, DataLoader(test, batch_size=50))
    merged = read_predictions(out / "predictions")
    with torch.no_grad():
        plain = model.cpu().eval()(torch.from_numpy(test.images)).numpy()
    report["predict"] = {
        "returned": repr(returned),
        "parent_writer_saw": len(writer._index),
        "files": sorted(p.name for p in (out / "predictions").iterdir()),
        "rows_per_rank": [int(np.load(out / "predictions" / f"rank0000{r}-of-00002.npz")
                              ["index"].size) for r in (0, 1)],
        "in_order": bool(np.array_equal(merged.index, np.arange(len(test)))),
        "duplicates": merged.duplicates,
        "max_gap": float(np.abs(merged.values - plain).max()),
    }

    model.train()
    try:
        fit.fit(model, train_loader, val_loader)
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    again = trainer(out, max_epochs=3, callbacks=[XLACountsCallback(out / "counts2")])
    again.fit(model, train_loader, val_loader, ckpt_path=checkpoint.best_model_path)
    report["refit"] = {"refused": refused, "parent_epoch": again.current_epoch,
                       "rank_epochs": {r: [e["epoch"] for e in c.epochs]
                                       for r, c in read_counts(out / "counts2").items()}}
    print("REPORT " + json.dumps(report))
'''


@pytest.mark.slow
def test_two_real_processes_fit_predict_and_refit(tmp_path, repo):
    proc = run_script(tmp_path, "ddp_shapes.py", SCRIPT, str(tmp_path / "out"))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))

    fit = report["fit"]
    assert fit["parent_epochs"] == 0  # the callback ran in the ranks' processes, not here
    assert set(fit["ranks"]) == {"0", "1"}
    for rank in fit["ranks"].values():
        assert rank["steps"] == [4, 4]  # each rank its own shard of the batches
        assert all(calls > 0 for calls in rank["reduce_calls"])  # sync_dist: a real reduce
    assert fit["weights_came_back"]  # rank 0's trained weights, loaded in this process
    assert fit["best"].endswith(".ckpt") and len(fit["ckpt_files"]) == 1  # rank 0 wrote once
    assert not [f for f in fit["ckpt_files"] if ".tmp" in f]
    assert fit["ckpt_epoch"] in (0, 1)

    pred = report["predict"]
    assert pred["returned"] == "None"  # a forking launcher: trainer.predict returns None
    assert pred["parent_writer_saw"] == 0  # the writer that ran lived in the ranks
    assert pred["files"] == ["merged.json", "rank00000-of-00002.npz", "rank00001-of-00002.npz"]
    assert pred["rows_per_rank"] == [180, 180]
    assert pred["in_order"] and pred["duplicates"] == 0
    assert pred["max_gap"] < 1e-5  # CPU against CPU

    refit = report["refit"]
    assert "twice on the same Trainer instance" in refit["refused"]
    resumed = list(range(fit["ckpt_epoch"] + 1, 3))  # from the epoch after the checkpoint's
    assert refit["rank_epochs"] == {"0": resumed, "1": resumed}
    assert refit["parent_epoch"] == 0  # loop counters are not sent back to this process
