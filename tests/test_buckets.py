"""tpu_helpers.buckets: every replica runs the same bucket at each step, evaluation scores
every sample exactly once, bad samples are errors naming their index (real torch + numpy).
The samplers take the GLOBAL batch per bucket, as data.py's loaders: 8 replicas load 1/8 each."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

from course.text import TextError, encode, load_speeches
from tpu_helpers.buckets import (
    BucketDataset,
    BucketError,
    BucketEvalSampler,
    BucketSampler,
    check_samples,
    collate,
    padding_share,
)

BOUNDS = (64, 128, 256)
GLOBAL = 128  # rows per step over all 8 replicas: 16 each


@pytest.fixture(scope="module")
def speeches():
    return load_speeches(max(BOUNDS))


def _bucket_per_step(sampler, lengths):
    """The bucket each step's rows belong to, read from the lengths (not from the plan)."""
    out = []
    for rows in sampler:
        real = [i for i in rows if i >= 0]
        found = {int(np.searchsorted(BOUNDS, lengths[i])) for i in real}
        assert len(found) <= 1, f"one step mixes buckets {found}"
        out.append(found.pop() if found else -1 - min(rows))
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_eight_replicas_run_the_same_bucket_at_every_step(speeches, drop_last):
    lengths = np.array([len(s) for s in speeches])
    buckets = check_samples(speeches, BOUNDS)
    for epoch in (0, 1):
        per_rank = []
        for rank in range(8):
            sampler = BucketSampler(buckets, GLOBAL, num_replicas=8, rank=rank, seed=3,
                                    drop_last=drop_last)
            sampler.set_epoch(epoch)
            per_rank.append(_bucket_per_step(sampler, lengths))
        print(f"epoch {epoch}: {len(per_rank[0])} steps, buckets of the first 8: "
              f"{per_rank[0][:8]}")
        assert all(r == per_rank[0] for r in per_rank), "replicas disagree on a step's bucket"
        assert len(set(per_rank[0])) == 3
    # the epoch changes the order; the seed fixes it
    a, b = (BucketSampler(buckets, GLOBAL, num_replicas=8, seed=3) for _ in range(2))
    b.set_epoch(1)
    assert list(a) != list(b) and list(a) == list(BucketSampler(buckets, GLOBAL, num_replicas=8,
                                                                 seed=3))


def test_training_rows_are_disjoint_and_drop_only_the_remainder(speeches):
    buckets = check_samples(speeches, BOUNDS)
    rows = [i for r in range(8) for step in BucketSampler(buckets, GLOBAL, num_replicas=8,
                                                           rank=r)
            for i in step]
    counts = np.bincount(buckets)
    kept = sum(c // GLOBAL * GLOBAL for c in counts)
    print(f"bucket sizes {counts.tolist()}, kept {len(rows)} of {len(buckets)}")
    assert len(rows) == len(set(rows)) == kept


def test_padding_share_buckets_versus_pad_to_max(speeches):
    lengths = [len(s) for s in speeches]
    buckets = check_samples(speeches, BOUNDS)
    ours = padding_share(lengths, BucketSampler(buckets, GLOBAL, num_replicas=8).steps(),
                         BOUNDS)
    one = np.zeros(len(lengths), dtype=np.int64)
    to_max = padding_share(lengths, BucketSampler(one, GLOBAL, num_replicas=8).steps(), (256,))
    print(f"padding share: buckets {ours:.3f}, pad to max {to_max:.3f}")
    assert 0.25 < ours < 0.35 and 0.6 < to_max < 0.72
    assert (1 - ours) / (1 - to_max) > 1.9  # real tokens per padded slot


def test_the_global_batch_is_split_over_the_replicas(speeches):
    buckets = check_samples(speeches, BOUNDS)
    for sampler_cls in (BucketSampler, BucketEvalSampler):
        rows = {}  # bucket length -> rows per step, per replica
        for rank in range(8):
            for step in sampler_cls(buckets, (32, 16, 8), num_replicas=8, rank=rank):
                real = [i for i in step if i >= 0]
                rows.setdefault(BOUNDS[buckets[real].max()] if real else None,
                                set()).add(len(step))
        rows.pop(None, None)
        print(sampler_cls.__name__, rows)
        assert rows == {64: {4}, 128: {2}, 256: {1}}  # global (32, 16, 8) / 8 replicas
    for bad in (12, (32, 16, 12)):
        with pytest.raises(BucketError, match="global batch 12 does not divide over 8 replicas"):
            BucketSampler(buckets, bad, num_replicas=8)
        with pytest.raises(BucketError, match="global batch 12 does not divide over 8 replicas"):
            BucketEvalSampler(buckets, bad, num_replicas=8)
    with pytest.raises(BucketError, match=r"one per bucket \(3\), got \(32, 16\)"):
        BucketSampler(buckets, (32, 16), num_replicas=8)


def test_eval_scores_every_sample_exactly_once_on_8_replicas(speeches):
    data = BucketDataset(speeches[:1001], BOUNDS)
    seen, steps = [], set()
    for rank in range(8):
        sampler = BucketEvalSampler(data.buckets, GLOBAL, num_replicas=8, rank=rank)
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate)
        widths = []
        for batch in loader:
            real = batch["index"] >= 0
            assert not batch["mask"][~real].any()
            assert (batch["mask"].sum(1)[real].numpy()
                    == [len(speeches[i]) for i in batch["index"][real]]).all()
            seen += batch["index"][real].tolist()
            widths.append(batch["tokens"].shape[1])
        steps.add(tuple(widths))
    print(f"{len(seen)} scored of 1001; step widths per rank: {steps}")
    assert sorted(seen) == list(range(1001))
    assert len(steps) == 1, "every replica must run the same widths in the same order"


def test_a_padding_row_alone_keeps_its_bucket_width():
    samples = [[5] * 10, [6] * 100, [7] * 200]  # one per bucket, 8 replicas: 7 pad rows each
    data = BucketDataset(samples, BOUNDS)
    widths = {r: [b["tokens"].shape[1] for b in DataLoader(
        data, batch_sampler=BucketEvalSampler(data.buckets, 8, num_replicas=8, rank=r),
        collate_fn=collate)] for r in range(8)}
    assert all(w == [64, 128, 256] for w in widths.values()), widths


@pytest.mark.parametrize("samples,message", [
    ([[1, 2], [], [3]], "sample 1 is empty"),
    ([[1] * 10, [2] * 257], "sample 1 has 257 tokens, more than the largest bucket (256)"),
    ([[1, 2], [3, 300]], "sample 1: token 300 is outside the vocabulary 0..255"),
    ([[1, 2], [[3]]], "sample 1: expected a 1-D sequence"),
    ([[1.5, 2.0]], "sample 0: expected a 1-D sequence of integer token ids"),
])
def test_bad_samples_are_errors_naming_the_index(samples, message):
    with pytest.raises(BucketError) as err:
        BucketDataset(samples, BOUNDS, vocab_size=256)
    print(err.value)
    assert message in str(err.value)


def test_bad_settings_are_errors():
    with pytest.raises(BucketError, match="strictly increasing"):
        check_samples([[1]], (128, 64))
    with pytest.raises(BucketError, match="rank 8 is not in 0..7"):
        BucketSampler(np.zeros(4, dtype=np.int64), 8, num_replicas=8, rank=8)
    with pytest.raises(BucketError, match="no full batch"):
        BucketSampler(np.zeros(4, dtype=np.int64), 8, num_replicas=8)
    with pytest.raises(BucketError, match="mixes buckets of lengths"):
        data = BucketDataset([[1] * 10, [2] * 100], BOUNDS)
        collate([data[0], data[1]])


def test_undecodable_bytes_are_errors_naming_the_sample():
    with pytest.raises(TextError, match=r"sample 2: byte 3 \(0xff\) is not UTF-8"):
        encode([b"To be", "caf\u00e9".encode(), b"or\n\xffnot"])
