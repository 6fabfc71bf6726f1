"""tpu_helpers.data on the shipped data: shapes, dtypes, splits, loaders (no XLA device)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from course import datasets as DS
from tpu_helpers import data as D


def test_data_dir_is_repo_data_and_env_override(monkeypatch, tmp_path: Path, repo: Path):
    monkeypatch.delenv("TPU_NB_DATA", raising=False)
    assert DS.data_dir() == repo / "data"
    monkeypatch.setenv("TPU_NB_DATA", str(tmp_path))
    assert DS.data_dir() == tmp_path
    monkeypatch.setenv("TPU_NB_DATA", str(tmp_path / "nope"))
    with pytest.raises(D.DataError, match="nope"):
        DS.data_dir()


def test_shipped_files_and_readme(repo: Path):
    d = repo / "data"
    assert len(list((d / "digits" / "images").glob("*.png"))) == 1797
    readme = (d / "README.md").read_text()
    assert "CC BY 4.0" in readme and "scikit-learn" in readme
    assert (d / "make_data.py").is_file() and (d / "breast_cancer.csv").is_file()


def test_load_digits_contract():
    x, y = DS.load_digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert set(np.unique(y)) == set(range(10))
    xtr, ytr = DS.load_digits("train")
    xte, yte = DS.load_digits("test")
    assert len(xtr) == 1437 and len(xte) == 360
    # normalised with the training split's statistics
    assert abs(float(xtr.mean())) < 0.01 and abs(float(xtr.std()) - 1) < 0.01
    # stratified: every class in both splits, in about the same proportion
    assert np.allclose(np.bincount(ytr) / len(ytr), np.bincount(yte) / len(yte), atol=0.01)
    # each call returns a fresh, writable array (the cache is not exposed)
    x[0] = 123.0
    assert DS.load_digits()[0][0, 0, 0, 0] != 123.0
    with pytest.raises(D.DataError, match="split"):
        DS.load_digits("validation")


def test_load_digits_matches_image_folder_dataset(repo: Path):
    ds = DS.ImageFolderDataset(repo / "data" / "digits", "test")
    x, y = DS.load_digits("test")
    assert len(ds) == 360
    xi, yi = ds[17]
    assert xi.shape == (1, 8, 8) and xi.dtype == torch.float32 and yi.dtype == torch.int64
    assert torch.equal(xi, torch.from_numpy(x[17])) and int(yi) == int(y[17])


def test_breast_cancer_csv():
    f, y = DS.load_tabular_csv(DS.data_dir() / "breast_cancer.csv", "target", num_classes=2)
    assert f.shape == (569, 30) and f.dtype == np.float32 and y.dtype == np.int64
    ftr, _ = DS.load_tabular_csv(DS.data_dir() / "breast_cancer.csv", "target", split="train")
    fte, _ = DS.load_tabular_csv(DS.data_dir() / "breast_cancer.csv", "target", split="test")
    assert len(ftr) + len(fte) == 569 and 100 <= len(fte) <= 120


def test_array_dataset_items_and_dtypes():
    ds = D.ArrayDataset(np.arange(12, dtype=np.float64).reshape(6, 2), [0, 1, 0, 1, 0, 1])
    x, y = ds[2]
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.tolist() == [4.0, 5.0] and int(y) == 0
    assert len(ds) == 6


def test_train_loader_fixed_shapes_sharding_and_set_epoch():
    x, y = DS.load_digits("train")
    ds = D.ArrayDataset(x, y, 10)
    seen = []
    for rank in range(4):
        loader = D.make_train_loader(ds, 256, world_size=4, rank=rank, seed=1)  # 64 each
        assert len(loader) == 1437 // 4 // 64 == 1437 // 256 == 5
        batches = list(loader)
        assert all(b[0].shape == (64, 1, 8, 8) and b[1].shape == (64,) for b in batches)
        first = list(loader.sampler)
        loader.sampler.set_epoch(1)
        assert list(loader.sampler) != first  # a new shuffle each epoch
        assert list(loader.sampler) == list(loader.sampler)  # without set_epoch: the same order
        loader.sampler.set_epoch(0)
        seen += first
    # the sampler gives 1437 // 4 = 359 per replica: the ragged tail of 1 is dropped, no repeats
    assert len(seen) == len(set(seen)) == 1436 and set(seen) <= set(range(1437))


def test_train_loader_drops_the_ragged_tail_instead_of_repeating():
    """10 samples on 4 replicas: 2 each, 8 distinct samples, 2 steps (a padding sampler would
    deal 3 each, repeating 2 samples, and add a third step)."""
    ds = D.ArrayDataset(np.arange(10, dtype=np.float32)[:, None], np.arange(10) % 2)
    shards = [list(D.make_train_loader(ds, 4, world_size=4, rank=r, seed=0).sampler)
              for r in range(4)]  # a global batch of 4: 1 row per replica per step
    visits = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [2] * 4 and len(set(visits)) == len(visits) == 8
    assert [len(D.make_train_loader(ds, 4, world_size=4, rank=r)) for r in range(4)] == [2] * 4
    with pytest.raises(D.DataError, match="3 samples over 4 replica.*use more data"):
        D.make_train_loader(D.ArrayDataset(np.zeros((3, 1), np.float32), [0, 1, 0]), 4,
                            world_size=4, rank=0)


def test_split_global_batch_divides_the_global_batch():
    assert D.split_global_batch(64, 8) == 8 and D.split_global_batch(64, 1) == 64
    with pytest.raises(D.DataError, match="global batch 64 does not divide over 3 replicas"):
        D.split_global_batch(64, 3)


def test_both_loaders_take_the_global_batch():
    """One meaning for the second argument of both loaders: the GLOBAL batch, split by
    per_replica_batch (a batch that does not divide is the same DataError)."""
    ds = D.ArrayDataset(np.zeros((100, 2), np.float32), np.arange(100) % 2)
    for world_size in (1, 2, 4):
        train = D.make_train_loader(ds, 8, world_size=world_size, rank=0)
        evaluate = D.make_eval_loader(ds, 8, world_size=world_size, rank=0)
        assert train.batch_size == evaluate.batch_size == 8 // world_size
        assert len(train) == 100 // 8 and len(evaluate) == -(-100 // 8)
    for make in (D.make_train_loader, D.make_eval_loader):
        with pytest.raises(D.DataError, match="global batch 8 does not divide over 3 replicas"):
            make(ds, 8, world_size=3, rank=0)
        with pytest.raises(D.DataError, match="global_batch must be >= 1, got 0"):
            make(ds, 0, world_size=1, rank=0)


def test_train_loader_is_the_loader_a_user_writes():
    """make_train_loader == DataLoader(ds, batch, sampler=DistributedSampler(...,
    drop_last=True), drop_last=True): the same batches for every rank and epoch (notebook 01
    writes that loader as replica_train_loader, which make_train_loader calls)."""
    from torch.utils.data import DataLoader, DistributedSampler

    x, y = DS.load_digits("test")
    ds = D.ArrayDataset(x, y, 10)
    for world_size in (1, 3):
        for rank in range(world_size):
            sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, seed=5,
                                         drop_last=True)
            mine = DataLoader(ds, batch_size=16, sampler=sampler, drop_last=True)
            toolkit = D.make_train_loader(ds, 16 * world_size, world_size=world_size, rank=rank,
                                          seed=5)
            for epoch in (0, 2):
                sampler.set_epoch(epoch)
                toolkit.sampler.set_epoch(epoch)
                pairs = list(zip(mine, toolkit, strict=True))
                assert pairs and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                     for a, b in pairs)


def test_train_loader_too_small_is_clear_and_eval_still_works():
    ds = D.ArrayDataset(np.zeros((6, 3), np.float32), np.arange(6) % 2)
    with pytest.raises(D.DataError, match=r"6 samples over 8 replica\(s\).*batch of 2 "
                                          r"\(global batch 16\)"):
        D.make_train_loader(ds, 16, world_size=8, rank=0)
    rows = []
    for rank in range(8):
        batches = list(D.make_eval_loader(ds, 16, world_size=8, rank=rank))
        assert len(batches) == 1
        xb, yb, ib, mb = batches[0]
        assert xb.shape == (2, 3) and mb.dtype == torch.bool and ib.dtype == torch.int64
        rows += ib[mb].tolist()
        assert (ib[~mb] == -1).all()
    assert sorted(rows) == list(range(6))


def test_replica_eval_indices_small_example():
    # 10 rows, batch 2, 3 replicas: padded to 12, dealt round-robin
    got = [D.replica_eval_indices(10, 2, 3, r) for r in range(3)]
    assert got == [[0, 3, 6, 9], [1, 4, 7, -1], [2, 5, 8, -1]]


def test_importing_data_does_not_touch_xla():
    import subprocess

    code = ("import sys, tpu_helpers.data, course.datasets as d; d.load_digits('test'); "
            "assert 'torch_xla' not in sys.modules, 'torch_xla imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
