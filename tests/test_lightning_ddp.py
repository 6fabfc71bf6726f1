"""Notebook 06 on 8 real processes: Lightning DDP over gloo on the CPU, as on a v5e-8.

On a multi-device TPU (8 on a v5e-8) ``Trainer(accelerator="tpu", devices="auto")`` forks one
process per device with ``_XLALauncher``, a ``_MultiProcessingLauncher``. XLA:CPU cannot run a
multi-process XLA strategy (pytorch/xla issue 9089), so the same launcher runs here with
``strategy="ddp_fork"`` (fork, like XLAStrategy) on the CPU with gloo, 8 ranks. DDP averages
the gradients over the ranks as ``XLAPrecision`` does (``xm.reduce_gradients``).

The run uses the notebook's own config cell (its data, global batch, steps per epoch, learning
rate, seed and thresholds, read from the notebook file) and checks what the notebook claims:

* the training sampler the notebook builds in each process (``DigitsData``:
  ``DistributedSampler(drop_last=True)``) is the one Lightning runs on every rank: 22 batches per
  epoch, and no sample seen twice in an epoch (Lightning's own sampler would repeat 3);
* the same global batch and optimizer steps as one process, and the notebook's ``MIN_VAL_ACC``
  and ``RERUN_MIN_ACC`` reached (with the per-process batch the notebook used before, 2 steps
  per epoch: 0.883 / 0.931 / 0.894 for seeds 0 / 1 / 2, below 0.93);
* callback state lives in each rank's process: the notebook's object stays empty, every rank
  writes its counts (:func:`course.lightning_demo.read_counts`), 8 records;
* rank 0 saves the checkpoint through ``AtomicXLACheckpointIO`` and the launching process gets
  the best path and rank 0's weights back, but not the loop counters;
* ``trainer.predict`` returns ``None``; the writer's 8 rank files and merged result hold every
  prediction exactly once, in dataset order, equal to a plain forward pass;
* the same Trainer refuses a second ``fit``; a new Trainer resumes from the checkpoint.
"""

from __future__ import annotations

import ast
import json
import time

import pytest
from conftest import REPO, run_script

WORLD = 8
NOTEBOOK = REPO / "notebooks" / "06_lightning_on_tpu.ipynb"
KNOBS = ("MAX_EPOCHS", "STEPS_PER_EPOCH", "GLOBAL_BATCH", "EVAL_BATCH", "PREDICT_BATCH", "LR",
         "SEED", "MIN_VAL_ACC", "RERUN_EPOCHS", "RERUN_MIN_ACC")


def notebook_config(smoke: bool) -> dict:
    """The notebook's config cell, run with ``SMOKE`` as CI (or a TPU user) would set it."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells
                  if "".join(c["source"]).startswith("# Config"))
    assigns = [node for node in ast.parse(source).body if isinstance(node, ast.Assign)
               and all(isinstance(t, ast.Name | ast.Tuple) for t in node.targets)]
    namespace: dict = {"SMOKE": smoke}
    for node in assigns:
        names = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if names <= set(KNOBS):
            exec(compile(ast.Module([node], []), "config", "exec"), namespace)
    config = {k: namespace[k] for k in KNOBS}
    return config


SCRIPT = r'''
import json, sys, time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from course.datasets import load_digits
from course.lightning_demo import DigitsData, LitDigits, XLACountsCallback, read_counts
from tpu_helpers.lightning_writer import ExactlyOncePredictionWriter, read_predictions
from tpu_helpers.data import ArrayDataset, split_global_batch
from tpu_helpers.tpu_lightning import AtomicXLACheckpointIO

WORLD = 8


def trainer(out, **kwargs):
    return L.Trainer(accelerator="cpu", devices=WORLD, plugins=[AtomicXLACheckpointIO()],
                     strategy=DDPStrategy(start_method="fork", process_group_backend="gloo"),
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=out, **kwargs)


class RecordShard(L.Callback):   # the indices this rank's training sampler gives each epoch
    def __init__(self, run_dir):
        self.run_dir = run_dir

    def on_train_epoch_start(self, trainer, pl_module):
        name = f"shard-{trainer.global_rank}-{trainer.current_epoch}.json"
        (self.run_dir / name).write_text(json.dumps(list(trainer.train_dataloader.sampler)))


def make_trainer(out, epochs, run_dir):   # the notebook's make_trainer, on 8 CPU ranks
    run_dir.mkdir(parents=True, exist_ok=True)
    callbacks = [XLACountsCallback(run_dir), RecordShard(run_dir),
                 ModelCheckpoint(dirpath=run_dir / "checkpoints", monitor="val_acc", mode="max")]
    return trainer(out, max_epochs=epochs, limit_train_batches=cfg["STEPS_PER_EPOCH"],
                   callbacks=callbacks)


if __name__ == "__main__":
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    train = ArrayDataset(*load_digits("train"))
    test = ArrayDataset(*load_digits("test"))
    batch = split_global_batch(cfg["GLOBAL_BATCH"], WORLD)   # as the notebook
    data = DigitsData(train, test, batch, split_global_batch(cfg["EVAL_BATCH"], WORLD),
                      seed=cfg["SEED"])
    report = {"batch": batch}

    start = time.perf_counter()
    L.seed_everything(cfg["SEED"])
    model = LitDigits(lr=cfg["LR"], loss_logging="logger")
    before = [p.detach().clone() for p in model.parameters()]
    fit = make_trainer(out, cfg["MAX_EPOCHS"], out / "run1")
    counts = next(c for c in fit.callbacks if isinstance(c, XLACountsCallback))
    fit.fit(model, datamodule=data)
    checkpoint = fit.checkpoint_callback
    ranks = read_counts(out / "run1")
    report["fit"] = {
        "seconds": time.perf_counter() - start,
        "val_acc": float(fit.callback_metrics["val_acc"]),
        "parent_epochs": len(counts.epochs), "parent_epoch": fit.current_epoch,
        "ranks": {r: [e["steps"] for e in c.epochs] for r, c in ranks.items()},
        "reduce_calls": {r: [e["reduce_calls"] for e in c.epochs] for r, c in ranks.items()},
        "loaders": {r: [[e["loader_batches"], e["sampler_drop_last"]] for e in c.epochs]
                    for r, c in ranks.items()},
        "shards": [[json.loads((out / "run1" / f"shard-{r}-{e}.json").read_text())
                    for r in range(WORLD)] for e in range(cfg["MAX_EPOCHS"])],
        "best": checkpoint.best_model_path,
        "weights_came_back": any(not torch.equal(a, b)
                                 for a, b in zip(before, model.parameters())),
        "ckpt_files": sorted(p.name for p in (out / "run1" / "checkpoints").iterdir()),
    }
    state = AtomicXLACheckpointIO().load_checkpoint(checkpoint.best_model_path)
    report["fit"]["ckpt_epoch"] = state["epoch"]

    writer = ExactlyOncePredictionWriter(out / "predictions")
    predict_loader = DataLoader(test, batch_size=cfg["PREDICT_BATCH"])
    returned = trainer(out, callbacks=[writer]).predict(model, predict_loader)
    merged = read_predictions(out / "predictions")
    with torch.no_grad():
        plain = model.cpu().eval()(torch.from_numpy(test.images)).numpy()
    report["predict"] = {
        "returned": repr(returned),
        "parent_writer_saw": len(writer._index),
        "files": sorted(p.name for p in (out / "predictions").iterdir()),
        "rows_per_rank": [int(np.load(out / "predictions" / f"rank{r:05d}-of-{WORLD:05d}.npz")
                              ["index"].size) for r in range(WORLD)],
        "in_order": bool(np.array_equal(merged.index, np.arange(len(test)))),
        "duplicates": merged.duplicates,
        "max_gap": float(np.abs(merged.values - plain).max()),
        "accuracy": float((merged.values.argmax(1) == test.labels).mean()),
    }

    model.train()
    try:
        fit.fit(model, datamodule=data)
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    again = trainer(out, max_epochs=cfg["MAX_EPOCHS"] + 1,
                    limit_train_batches=cfg["STEPS_PER_EPOCH"],
                    callbacks=[XLACountsCallback(out / "resumed")])
    again.fit(model, datamodule=data, ckpt_path=checkpoint.best_model_path)
    report["resume"] = {"refused": refused, "parent_epoch": again.current_epoch,
                        "rank_epochs": {r: [e["epoch"] for e in c.epochs]
                                        for r, c in read_counts(out / "resumed").items()}}

    start = time.perf_counter()   # section 6: a new Trainer and a new model
    L.seed_everything(cfg["SEED"])
    rerun = make_trainer(out, cfg["RERUN_EPOCHS"], out / "run2")
    rerun.fit(LitDigits(lr=cfg["LR"], loss_logging="logger"), datamodule=data)
    report["rerun"] = {"seconds": time.perf_counter() - start,
                       "val_acc": float(rerun.callback_metrics["val_acc"]),
                       "ranks": {r: [e["steps"] for e in c.epochs]
                                 for r, c in read_counts(out / "run2").items()}}
    print("REPORT " + json.dumps(report))
'''


def run_notebook_on_8_ranks(tmp_path, config: dict) -> dict:
    proc = run_script(tmp_path, "nb06_on_8_ranks.py", SCRIPT, str(tmp_path / "out"),
                      json.dumps(config))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


@pytest.mark.slow
def test_notebook_06_on_8_real_processes(tmp_path):
    cfg = notebook_config(smoke=True)   # what CI runs; the full settings train longer
    start = time.perf_counter()
    report = run_notebook_on_8_ranks(tmp_path, cfg)
    print(f"8 ranks: {time.perf_counter() - start:.0f} s; {json.dumps(report['fit'])[:300]}")
    ranks = [str(r) for r in range(WORLD)]
    steps = [cfg["STEPS_PER_EPOCH"]] * cfg["MAX_EPOCHS"]
    assert report["batch"] * WORLD == cfg["GLOBAL_BATCH"]

    fit = report["fit"]
    assert fit["ranks"] == dict.fromkeys(ranks, steps)   # one process's steps on every rank
    assert fit["val_acc"] >= cfg["MIN_VAL_ACC"], fit["val_acc"]   # the notebook's threshold
    assert fit["parent_epochs"] == 0 and fit["parent_epoch"] == 0   # not sent back
    assert all(calls > 0 for c in fit["reduce_calls"].values() for calls in c)  # sync_dist
    # every rank ran the notebook's own sampler: drop_last, 179 // 8 = 22 batches per epoch ...
    assert fit["loaders"] == dict.fromkeys(ranks, [[22, True]] * cfg["MAX_EPOCHS"])
    for epoch in fit["shards"]:   # ... and no sample twice in an epoch: 8 x 179, 5 dropped
        seen = [i for shard in epoch for i in shard]
        assert [len(s) for s in epoch] == [179] * WORLD and len(set(seen)) == len(seen) == 1432
    assert fit["weights_came_back"]   # rank 0's trained weights, loaded in this process
    assert fit["best"].endswith(".ckpt") and len(fit["ckpt_files"]) == 1   # rank 0 wrote once
    assert not [f for f in fit["ckpt_files"] if ".tmp" in f]

    pred = report["predict"]
    assert pred["returned"] == "None"   # a forking launcher: trainer.predict returns None
    assert pred["parent_writer_saw"] == 0   # the writer that ran lived in the ranks
    assert pred["files"] == ["merged.json"] + [f"rank{r:05d}-of-00008.npz" for r in range(8)]
    assert pred["rows_per_rank"] == [45] * WORLD   # 360 test images
    assert pred["in_order"] and pred["duplicates"] == 0
    assert pred["max_gap"] < 1e-5   # CPU against CPU
    assert pred["accuracy"] >= cfg["MIN_VAL_ACC"]

    resume = report["resume"]
    assert "twice on the same Trainer instance" in resume["refused"]
    resumed = list(range(fit["ckpt_epoch"] + 1, cfg["MAX_EPOCHS"] + 1))
    assert resume["rank_epochs"] == dict.fromkeys(ranks, resumed)
    assert resume["parent_epoch"] == 0   # loop counters are not sent back to this process

    rerun = report["rerun"]
    assert rerun["ranks"] == dict.fromkeys(ranks, [cfg["STEPS_PER_EPOCH"]] * cfg["RERUN_EPOCHS"])
    assert rerun["val_acc"] >= cfg["RERUN_MIN_ACC"], rerun["val_acc"]
