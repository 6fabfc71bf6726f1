"""No load path of this package runs code from a file.

Every file this package reads back (a single checkpoint, the newest of a folder, the
training script's resume, Lightning's resume and rank files, prediction rank files and
sharded checkpoints) is given a crafted payload whose ``__reduce__`` creates a folder when
unpickled. Each must be refused with an error that names the file and says why, and the
folder must not appear. The first test shows the payload is real: plain ``pickle`` runs it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO

from tpu_helpers.checkpoint import (
    CheckpointDir,
    CheckpointError,
    UnsafeCheckpointError,
    load_checkpoint,
)
from tpu_helpers.ordering import PredictionError, merge_rank_files


class Payload:
    """Unpickling this calls ``os.makedirs(marker)``: harmless, and easy to see."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "CODE-RAN"


def evil_torch_file(path: Path, marker: Path) -> Path:
    """A torch.save zip file whose state dict holds the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.ones(2)}, "step": 3, "extra": Payload(marker)}, path)
    return path


def test_the_payload_is_real_plain_pickle_runs_it(tmp_path, marker):
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.is_dir()


@pytest.mark.parametrize("kind", ["torch.save zip", "raw pickle"])
def test_single_file_is_refused_as_not_plain_not_called_corrupt(tmp_path, marker, kind):
    path = tmp_path / "ckpt.pt"
    if kind == "raw pickle":
        path.write_bytes(pickle.dumps({"step": 1, "x": Payload(marker)}, protocol=2))
    else:
        evil_torch_file(path, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "refused: not a plain checkpoint" in message
    assert "makedirs" in message  # names what it would have built
    assert "corrupt" not in message
    assert not marker.exists()


def test_garbage_is_corrupt_not_a_raw_error(tmp_path):
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"hello world, not a checkpoint " * 10)  # raised a bare KeyError
    with pytest.raises(CheckpointError, match=r"garbage\.pt: corrupt or truncated"):
        load_checkpoint(path)


def test_newest_of_folder_is_refused_not_skipped_for_an_older_one(tmp_path, marker):
    ckpts = CheckpointDir(tmp_path / "checkpoints", keep=None)
    ckpts.save({"step": 5}, step=5, is_writer=True, barrier=lambda: None)
    evil_torch_file(ckpts.path_for(10), marker)
    with pytest.raises(UnsafeCheckpointError, match=r"step-00000010\.pt: refused"):
        ckpts.load_latest()
    assert not marker.exists()


def test_training_script_resume_refuses_the_file(tmp_path, marker):
    out = tmp_path / "run"
    evil_torch_file(CheckpointDir(out / "checkpoints").path_for(6), marker)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_helpers.train", "--out-dir", str(out), "--epochs", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "step-00000006.pt: refused: not a plain checkpoint" in proc.stderr
    assert not marker.exists()


def test_lightning_resume_and_load_refuse_the_file(tmp_path, marker):
    from tpu_helpers.tpu_lightning import AtomicXLACheckpointIO

    path = evil_torch_file(tmp_path / "epoch=0.ckpt", marker)
    io_plugin = AtomicXLACheckpointIO()
    for weights_only in (None, True, False):  # even when asked for a full unpickle
        with pytest.raises(UnsafeCheckpointError, match=r"epoch=0\.ckpt: refused"):
            io_plugin.load_checkpoint(path, weights_only=weights_only)
    assert not marker.exists()


def test_lightning_trainer_fit_from_the_file_is_refused(tmp_path, marker):
    import lightning as L
    from torch.utils.data import DataLoader

    from course.datasets import load_digits
    from course.lightning_demo import LitDigits
    from course.lightning_demo import trainer_kwargs_here as trainer_kwargs
    from tpu_helpers.data import ArrayDataset

    path = evil_torch_file(tmp_path / "last.ckpt", marker)
    trainer = L.Trainer(**trainer_kwargs(), max_epochs=1, limit_train_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    loader = DataLoader(ArrayDataset(*load_digits("train")), batch_size=32, drop_last=True)
    with pytest.raises(UnsafeCheckpointError, match=r"last\.ckpt: refused"):
        trainer.fit(LitDigits(), loader, ckpt_path=path)
    assert not marker.exists()


def test_lightning_rank_and_merged_files_are_refused(tmp_path, marker):
    """The Lightning writer's files use predict's rank-file protocol: npz read without pickle
    and a JSON record; a crafted rank file or record is refused by name, no code runs."""
    from tpu_helpers.lightning_writer import MERGED_FILE, read_predictions
    from tpu_helpers.ordering import rank_file_name

    (tmp_path / MERGED_FILE).write_text(json.dumps({"world_size": 1, "n": 2}))
    (tmp_path / rank_file_name(0, 1)).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(PredictionError, match=r"rank00000-of-00001\.npz"):
        read_predictions(tmp_path)
    (tmp_path / MERGED_FILE).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(PredictionError, match=MERGED_FILE.replace(".", r"\.")):
        read_predictions(tmp_path)
    assert not marker.exists()


def test_prediction_rank_files_are_refused(tmp_path, marker):
    values = np.empty(2, dtype=object)
    values[:] = [Payload(marker), Payload(marker)]
    buf = io.BytesIO()
    np.savez(buf, index=np.arange(2), mask=np.ones(2, bool), values=values, rank=0,
             world_size=1, n=2)
    path = tmp_path / "rank00000-of-00001.npz"
    path.write_bytes(buf.getvalue())
    with pytest.raises(PredictionError, match=r"rank00000-of-00001\.npz: refused: not a plain"):
        merge_rank_files(tmp_path, world_size=1, n=2)
    path.write_bytes(pickle.dumps(Payload(marker)))  # not even an npz
    with pytest.raises(PredictionError, match=r"rank00000-of-00001\.npz: "):
        merge_rank_files(tmp_path, world_size=1, n=2)
    assert not marker.exists()


SHARDED = """
import json, os, pickle, sys
import torch
import torch_xla, torch_xla.runtime as xr
xr.use_spmd()
import torch_xla.distributed.spmd as xs
from tpu_helpers.sharded_checkpoint import (ShardedCheckpointError, load_sharded_checkpoint,
                                            save_sharded_checkpoint)
from tpu_helpers.spmd import device_mesh

out, marker = sys.argv[1], sys.argv[2]
class Payload:
    def __reduce__(self):
        return (os.makedirs, (marker,))

model = torch.nn.Linear(8, 4).to(torch_xla.device())
xs.mark_sharding(model.weight, device_mesh(("data",)), ("data", None))
good = save_sharded_checkpoint({"model": model.state_dict()}, out + "/good")
load_sharded_checkpoint({"model": model.state_dict()}, good)  # a real one still loads
results = {}
def attempt(name):
    try:
        load_sharded_checkpoint({"model": model.state_dict()}, good)
        results[name] = "loaded"
    except ShardedCheckpointError as exc:
        results[name] = str(exc)
meta = good / ".metadata"
original = meta.read_bytes()
import dataclasses
from tpu_helpers.sharded_checkpoint import _SafeReader
traversal = _SafeReader(good).read_metadata()  # the real metadata, one path changed
traversal.storage_data = {k: dataclasses.replace(v, relative_path="../../x.distcp")
                          for k, v in traversal.storage_data.items()}
meta.write_bytes(pickle.dumps(Payload()))
attempt("payload")
meta.write_bytes(pickle.dumps(traversal))
attempt("traversal")
meta.write_bytes(original[: len(original) // 2])
attempt("truncated")
print(json.dumps(results))
"""


def test_sharded_checkpoint_metadata_cannot_run_code(tmp_path, marker):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path), str(marker)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not marker.exists()
    assert ".metadata: refused: not a plain checkpoint metadata file" in results["payload"]
    assert "makedirs" in results["payload"]
    assert "refused: names data file '../../x.distcp'" in results["traversal"]
    assert ".metadata: corrupt or truncated" in results["truncated"]
