"""Text of any length without recompiling: length buckets (torch + numpy + stdlib only).

Taught in notebook 09. Needs no sibling. A batch holds samples of one bucket padded to its
length (``boundaries``, e.g. ``(64, 128, 256)``): at most one graph per bucket. Every replica
gets the same bucket at each step. The samplers take the GLOBAL batch per bucket (rows one
optimizer step takes over ALL replicas, as data.py's loaders): each replica loads
``global_batch // num_replicas``. ``DataLoader(BucketDataset(samples, boundaries),
batch_sampler=BucketSampler(...), collate_fn=collate)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class BucketError(ValueError):
    """A bad sample or bucket setting, found on the host before anything compiles."""


def check_boundaries(boundaries: Sequence[int]) -> tuple[int, ...]:
    """``boundaries`` as a tuple of strictly increasing positive ints, or a BucketError."""
    out = tuple(int(b) for b in boundaries)
    if not out or out[0] < 1 or any(a >= b for a, b in zip(out, out[1:], strict=False)):
        raise BucketError(f"bucket boundaries must be strictly increasing positive lengths, "
                          f"got {list(boundaries)}.")
    return out


def check_samples(samples: Sequence[Any], boundaries: Sequence[int],
                  vocab_size: int | None = None) -> np.ndarray:
    """Each sample's bucket (int64 ``[N]``): the smallest boundary >= its length.

    ``samples`` are 1-D integer token sequences (lists, numpy arrays or tensors). Raises a
    :class:`BucketError` naming the first bad sample's index: empty, not 1-D integers, longer
    than the largest bucket, or (with ``vocab_size``) a token outside ``0..vocab_size-1``.
    """
    bounds = check_boundaries(boundaries)
    if len(samples) == 0:
        raise BucketError("no samples: the dataset is empty.")
    lengths = np.empty(len(samples), dtype=np.int64)
    for i, sample in enumerate(samples):
        arr = np.asarray(sample)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise BucketError(f"sample {i}: expected a 1-D sequence of integer token ids, "
                              f"got shape {list(arr.shape)} {arr.dtype}.")
        if arr.size == 0:
            raise BucketError(f"sample {i} is empty (0 tokens): drop it before batching.")
        if arr.size > bounds[-1]:
            raise BucketError(f"sample {i} has {arr.size} tokens, more than the largest bucket "
                              f"({bounds[-1]}): split or crop it, or add a bucket.")
        if vocab_size is not None and (arr.min() < 0 or arr.max() >= vocab_size):
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise BucketError(f"sample {i}: token {bad} is outside the vocabulary "
                              f"0..{vocab_size - 1}.")
        lengths[i] = arr.size
    return np.searchsorted(np.asarray(bounds), lengths, side="left").astype(np.int64)


def _per_replica_batches(global_batch: int | Sequence[int], num_buckets: int,
                         num_replicas: int) -> list[int]:
    """Rows one replica loads per step, per bucket: each global batch split over the replicas
    with ``data.split_global_batch``'s rule and message (here a BucketError)."""
    sizes = [global_batch] * num_buckets if isinstance(global_batch, int) else list(global_batch)
    if len(sizes) != num_buckets or any(int(s) < 1 for s in sizes):
        raise BucketError(f"global_batch must be a positive int or one per bucket "
                          f"({num_buckets}), got {global_batch!r}.")
    for size in sizes:
        if int(size) % num_replicas:
            raise BucketError(f"global batch {size} does not divide over {num_replicas} "
                              "replicas: make it a multiple of the world size.")
    return [int(s) // num_replicas for s in sizes]


def _check_replicas(num_replicas: int, rank: int) -> None:
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise BucketError(f"rank {rank} is not in 0..{num_replicas - 1} "
                          f"(num_replicas={num_replicas}).")


def train_plan(buckets: np.ndarray, global_batch: int | Sequence[int], num_replicas: int,
               seed: int, epoch: int, drop_last: bool = True,
               shuffle: bool = True) -> list[tuple[int, np.ndarray]]:
    """The epoch's steps for ALL replicas: ``(bucket, index [num_replicas, global_batch //
    num_replicas])`` each, the same on every replica. Per bucket, samples are shuffled with
    ``(seed, epoch)`` and cut into global batches (the remainder dropped, or filled with
    repeats); then all steps are shuffled together."""
    nb = int(buckets.max()) + 1 if buckets.size else 0
    sizes = _per_replica_batches(global_batch, nb, num_replicas)
    rng = np.random.default_rng([seed, epoch])
    steps = []
    for b in range(nb):
        idx = np.flatnonzero(buckets == b)
        idx = rng.permutation(idx) if shuffle else idx
        g = sizes[b] * num_replicas
        if drop_last:
            idx = idx[: len(idx) // g * g]
        elif len(idx) % g:
            idx = np.resize(idx, len(idx) + (-len(idx) % g))  # repeats from the bucket's start
        steps += [(b, chunk) for chunk in idx.reshape(-1, num_replicas, sizes[b])]
    order = rng.permutation(len(steps)) if shuffle else range(len(steps))
    return [steps[i] for i in order]


def eval_plan(buckets: np.ndarray, global_batch: int | Sequence[int],
              num_replicas: int) -> list[tuple[int, np.ndarray]]:
    """Evaluation steps for all replicas: every sample in exactly one row, in order of bucket.

    Padding rows (to fill a bucket's last global batch) hold ``-1 - bucket``: a masked row of
    that bucket, so every replica still runs the bucket's graph.
    """
    nb = int(buckets.max()) + 1 if buckets.size else 0
    sizes = _per_replica_batches(global_batch, nb, num_replicas)
    steps = []
    for b in range(nb):
        idx = np.flatnonzero(buckets == b)
        g = sizes[b] * num_replicas
        idx = np.concatenate([idx, np.full(-len(idx) % g, -1 - b, dtype=np.int64)])
        steps += [(b, chunk) for chunk in idx.reshape(-1, num_replicas, sizes[b])]
    return steps


class BucketSampler(Sampler[list[int]]):
    """A ``batch_sampler`` for training: this replica's rows of :func:`train_plan`, batches of
    ``global_batch // num_replicas`` (``global_batch``: rows per step over all replicas, an int
    or one per bucket). Call :meth:`set_epoch` before each epoch (as with
    ``DistributedSampler``).
    """

    def __init__(self, buckets: np.ndarray, global_batch: int | Sequence[int], *,
                 num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 drop_last: bool = True, shuffle: bool = True) -> None:
        _check_replicas(num_replicas, rank)
        self.buckets, self.global_batch = np.asarray(buckets, dtype=np.int64), global_batch
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.drop_last, self.shuffle, self.epoch = drop_last, shuffle, 0
        if not self.steps():
            raise BucketError(f"no full batch: every bucket has fewer samples than its "
                              f"global batch ({global_batch}); use drop_last=False or a "
                              "smaller batch.")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def steps(self) -> list[tuple[int, np.ndarray]]:
        """This epoch's plan for all replicas (the same list on every replica)."""
        return train_plan(self.buckets, self.global_batch, self.num_replicas, self.seed,
                          self.epoch, self.drop_last, self.shuffle)

    def __iter__(self) -> Iterator[list[int]]:
        for _, chunk in self.steps():
            yield chunk[self.rank].tolist()

    def __len__(self) -> int:
        return len(self.steps())


class BucketEvalSampler(Sampler[list[int]]):
    """A ``batch_sampler`` for evaluation: this replica's rows of :func:`eval_plan`, batches
    of ``global_batch // num_replicas`` (``global_batch`` as in :class:`BucketSampler`)."""

    def __init__(self, buckets: np.ndarray, global_batch: int | Sequence[int], *,
                 num_replicas: int = 1, rank: int = 0) -> None:
        _check_replicas(num_replicas, rank)
        self.plan = eval_plan(np.asarray(buckets, dtype=np.int64), global_batch, num_replicas)
        self.rank = rank

    def __iter__(self) -> Iterator[list[int]]:
        for _, chunk in self.plan:
            yield chunk[self.rank].tolist()

    def __len__(self) -> int:
        return len(self.plan)


class BucketDataset(Dataset):
    """Checked samples (:func:`check_samples`); item ``i`` is ``(i, tokens, bucket_length)``.

    Index ``-1 - b`` (a padding row from :func:`eval_plan`) gives ``(-1, [], length of b)``.
    """

    def __init__(self, samples: Sequence[Any], boundaries: Sequence[int],
                 vocab_size: int | None = None) -> None:
        self.boundaries = check_boundaries(boundaries)
        self.buckets = check_samples(samples, self.boundaries, vocab_size)
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, int]:
        if i < 0:
            return -1, torch.zeros(0, dtype=torch.long), self.boundaries[-1 - i]
        tokens = torch.as_tensor(np.asarray(self.samples[i]), dtype=torch.long)
        return i, tokens, self.boundaries[self.buckets[i]]


def collate(items: Sequence[tuple[int, torch.Tensor, int]],
            pad_id: int = 0) -> dict[str, torch.Tensor]:
    """``tokens`` int64 ``[B, L]`` padded with ``pad_id`` to the bucket length ``L``, ``mask``
    bool ``[B, L]`` (True on real tokens) and ``index`` int64 ``[B]`` (-1: padding row)."""
    lengths = {length for _, _, length in items}
    if len(lengths) != 1:
        raise BucketError(f"a batch mixes buckets of lengths {sorted(lengths)}: use "
                          "BucketSampler or BucketEvalSampler as the batch_sampler.")
    width = lengths.pop()
    tokens = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.bool)
    for row, (_, seq, _) in enumerate(items):
        tokens[row, : len(seq)], mask[row, : len(seq)] = seq, True
    index = torch.tensor([i for i, _, _ in items], dtype=torch.long)
    return {"tokens": tokens, "mask": mask, "index": index}


def padding_share(lengths: Sequence[int], steps: Sequence[tuple[int, np.ndarray]],
                  boundaries: Sequence[int]) -> float:
    """The share of token slots that are padding over a plan's ``steps`` (all replicas).
    Padding rows (negative indices) count as all padding."""
    bounds, lengths = check_boundaries(boundaries), np.asarray(lengths)
    slots = real = 0
    for b, chunk in steps:
        idx = chunk.reshape(-1)
        slots += idx.size * bounds[b]
        real += int(lengths[idx[idx >= 0]].sum())
    return 1.0 - real / slots if slots else 0.0
