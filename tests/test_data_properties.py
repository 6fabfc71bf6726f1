"""Property tests (hypothesis) of sharding + padding + masks.

Over dataset sizes 1..500, world sizes 1..8 and batch sizes 1..64: every dataset index
appears in exactly one real (unmasked) row across all replicas, all replicas run the same
number of steps, and every batch has the same shape. Real DataLoaders over real data.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpu_helpers import data as D

sizes = st.integers(1, 500)
worlds = st.integers(1, 8)
batches = st.integers(1, 64)


@settings(max_examples=400, deadline=None)
@given(n=sizes, world_size=worlds, batch_size=batches)
@example(n=6, world_size=8, batch_size=1)  # the custom-dataset article's 6 samples on 8 cores
@example(n=1, world_size=8, batch_size=64)
@example(n=500, world_size=8, batch_size=64)
def test_replica_eval_indices_exactly_once(n, world_size, batch_size):
    shards = [np.asarray(D.replica_eval_indices(n, batch_size, world_size, r))
              for r in range(world_size)]
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1, "replicas would run different numbers of steps"
    (length,) = lengths
    assert length % batch_size == 0 and length >= batch_size
    steps = length // batch_size
    assert steps == math.ceil(n / (batch_size * world_size))  # no wasted all-padding step
    flat = np.concatenate(shards)
    real = flat[flat >= 0]
    assert np.array_equal(np.sort(real), np.arange(n)), "an index is lost or duplicated"
    assert set(flat[flat < 0].tolist()) <= {-1}
    assert (flat == -1).sum() == steps * batch_size * world_size - n


def _dataset(n: int) -> D.ArrayDataset:
    # feature value = dataset index, so each row says where it came from
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)
    return D.ArrayDataset(x, np.arange(n) % 10, num_classes=10)


@settings(max_examples=60, deadline=None)
@given(n=sizes, world_size=worlds, batch_size=batches)
@example(n=6, world_size=8, batch_size=1)
@example(n=1, world_size=8, batch_size=4)
def test_eval_loader_rows_masks_and_shapes(n, world_size, batch_size):
    ds = _dataset(n)
    steps, real_rows = set(), []
    for rank in range(world_size):
        loader = D.make_eval_loader(ds, batch_size * world_size, world_size=world_size,
                                    rank=rank)  # the global batch
        out = list(loader)
        steps.add(len(out))
        assert len(out) == len(loader)
        for x, y, index, mask in out:
            assert x.shape == (batch_size, 3) and y.shape == index.shape == mask.shape == (
                batch_size,)
            assert str(mask.dtype) == "torch.bool" and str(index.dtype) == "torch.int64"
            assert bool((index[~mask] == -1).all()) and bool((index[mask] >= 0).all())
            # the row's content is the sample at that index; padding rows are zeros
            assert np.array_equal(x[mask][:, 0].numpy(), index[mask].numpy().astype(np.float32))
            assert not x[~mask].any()
            real_rows += index[mask].tolist()
    assert len(steps) == 1
    assert sorted(real_rows) == list(range(n))


@settings(max_examples=60, deadline=None)
@given(n=sizes, world_size=worlds, batch_size=batches, seed=st.integers(0, 3),
       epoch=st.integers(0, 3))
@example(n=1, world_size=8, batch_size=1, seed=0, epoch=0)
@example(n=6, world_size=8, batch_size=1, seed=0, epoch=1)
@example(n=6, world_size=8, batch_size=2, seed=0, epoch=0)
def test_train_loader_equal_steps_fixed_shape_or_clear_error(n, world_size, batch_size, seed,
                                                             epoch):
    ds = _dataset(n)
    per_replica = n // world_size
    if per_replica < batch_size:
        with pytest.raises(D.DataError, match="training set too small"):
            D.make_train_loader(ds, batch_size * world_size, world_size=world_size, rank=0)
        return
    steps, sampled = set(), []
    for rank in range(world_size):
        loader = D.make_train_loader(ds, batch_size * world_size, world_size=world_size,
                                     rank=rank, seed=seed)  # the global batch
        loader.sampler.set_epoch(epoch)
        out = list(loader)
        steps.add(len(out))
        assert all(x.shape == (batch_size, 3) and y.shape == (batch_size,) for x, y in out)
        sampled += list(loader.sampler)
    assert steps == {n // world_size // batch_size}
    assert steps != {0}
    # the sampler drops the ragged tail (n % world_size samples) and repeats nothing
    counts = np.bincount(sampled, minlength=n)
    assert counts.max() == 1 and counts.sum() == per_replica * world_size
