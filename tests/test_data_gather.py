"""make_train_loader fetches an in-memory dataset's batch with one gather per field: the
batches are bit-identical to collating the items one by one (the loader before the gather),
in the same order, on every replica and epoch; datasets that define their own items still go
item by item (and keep the errors naming a bad item's dataset index)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset, default_collate

from tpu_helpers import data as D


def _arrays(n: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((n, 1, 8, 8)) * 100).astype(dtype)
    return x, rng.integers(0, 10, n).astype(np.int64)


class _PerItem(D.ArrayDataset):
    """The same items, defined here: the loader must fetch and check them one by one."""

    def __getitem__(self, index):
        return super().__getitem__(index)

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def _per_item_batches(dataset, batch, world, rank, seed, epoch):
    """The batches as the loader made them before the gather: sampler order, items one by
    one, default_collate, full batches only."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [default_collate([dataset[i] for i in order[k:k + batch]])
            for k in range(0, len(order) - batch + 1, batch)]


def _same(got, want) -> None:
    assert type(got) is type(want) is list and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert g.is_contiguous() and torch.equal(g, w)
        assert g.numpy().tobytes() == w.numpy().tobytes()  # bit-identical, NaN-safe


@pytest.mark.parametrize("make", ["array_f32", "array_u8", "tensor"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gathered_batches_equal_per_item_batches(make, world):
    x, y = _arrays(203, np.uint8 if make == "array_u8" else np.float32)
    dataset = (TensorDataset(torch.from_numpy(x), torch.from_numpy(y)) if make == "tensor"
               else D.ArrayDataset(x, y))
    global_batch = 12 * world
    for rank in range(world):
        loader = D.make_train_loader(dataset, global_batch, world_size=world, rank=rank, seed=5)
        assert isinstance(loader.dataset.__getitems__([0, 1]), D._Gathered)  # the fast path
        for epoch in (0, 3):
            loader.sampler.set_epoch(epoch)
            got = list(loader)
            want = _per_item_batches(dataset, 12, world, rank, 5, epoch)
            assert len(got) == len(want) == len(dataset) // global_batch
            for g, w in zip(got, want, strict=True):
                _same(g, w)


def test_gathered_batches_equal_through_worker_processes():
    x, y = _arrays(100, np.float32)
    dataset = D.ArrayDataset(x, y)
    fast = D.make_train_loader(dataset, 16, world_size=1, rank=0, num_workers=1)
    slow = D.make_train_loader(_PerItem(x, y), 16, world_size=1, rank=0)
    assert not isinstance(slow.dataset.__getitems__([0, 1]), D._Gathered)
    for g, w in zip(list(fast), list(slow), strict=True):
        _same(g, w)


def test_fit_loaders_gather_and_equal_per_item():
    """train.fit's loaders (make_loaders) take the fast path and give the same batches."""
    from types import SimpleNamespace

    x, y = _arrays(150, np.float32)
    config = SimpleNamespace(global_batch=32, eval_global_batch=32, seed=3)
    fast, _ = D.make_loaders(D.ArrayDataset(x, y), None, config, world=1, rank=0)
    slow, _ = D.make_loaders(_PerItem(x, y), None, config, world=1, rank=0)
    assert isinstance(fast.dataset.__getitems__([0]), D._Gathered)
    got, want = list(fast), list(slow)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        _same(g, w)


def test_own_items_still_checked_per_item():
    """A dataset with its own __getitem__ is not gathered: a bad item is still named."""

    class Odd(_PerItem):
        def __getitem__(self, index):
            x, y = super().__getitem__(index)
            return (x[:, :4] if index == 9 else x), y

    x, y = _arrays(40, np.float32)
    loader = D.make_train_loader(Odd(x, y), 40, world_size=1, rank=0)
    with pytest.raises(D.DataError, match="dataset index 9: x has shape"):
        next(iter(loader))


def test_a_subclass_overriding_getitem_only_is_not_skipped():
    """An ArrayDataset subclass that augments in __getitem__ alone gets its items, in a plain
    DataLoader (which prefers the inherited __getitems__) and in the toolkit's loader."""

    class Flipped(D.ArrayDataset):
        def __getitem__(self, index):
            x, y = super().__getitem__(index)
            return -x, y

    x, y = _arrays(40, np.float32)
    data = Flipped(x, y)
    plain = next(iter(torch.utils.data.DataLoader(data, batch_size=8)))
    ours = next(iter(D.make_train_loader(data, 40, world_size=1, rank=0)))
    assert torch.equal(plain[0], -torch.from_numpy(x[:8]))
    assert any(torch.equal(ours[0][i], -torch.from_numpy(x[j]))
               for i in range(len(ours[0])) for j in range(len(x)))
    assert not any(torch.equal(ours[0][i], torch.from_numpy(x[j]))
                   for i in range(len(ours[0])) for j in range(len(x)))
