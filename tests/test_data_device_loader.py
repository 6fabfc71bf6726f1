"""MpDeviceLoader facts and StrictDeviceLoader, on a real XLA:CPU device (one device).

* pl.MpDeviceLoader does not change the batch size and does not shard (seed 002's myth).
* In torch_xla 2.9 an exception in the host loader silently ENDS the epoch early under
  MpDeviceLoader; StrictDeviceLoader raises it instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tpu_helpers import data as D
from tpu_helpers.device_loader import (
    StrictDeviceLoader,
    compare_loops,
    device_loader_loop,
    naive_loop,
    sgd_step,
)


@pytest.fixture(scope="module")
def device():
    import torch_xla

    return torch_xla.device()


class FailsAt(Dataset):
    """40 samples; __getitem__ raises at one index (like a file that went bad)."""

    def __init__(self, bad: int | None) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == self.bad:
            raise D.DataError(f"sample {i}: broken")
        return torch.full((3,), float(i)), torch.tensor(i)


def test_mp_device_loader_keeps_batch_size_and_does_not_shard(device):
    import torch_xla.distributed.parallel_loader as pl

    loader = DataLoader(FailsAt(None), batch_size=1)  # seed 002: "adjusted later": no
    shapes, seen = set(), []
    for x, y in pl.MpDeviceLoader(loader, device):
        shapes.add(tuple(x.shape))
        seen += y.cpu().tolist()
    assert shapes == {(1, 3)}
    assert seen == list(range(40))  # the whole dataset: no sharding happened


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_plain_mp_device_loader_swallows_host_errors(device):
    """Documents the upstream behaviour StrictDeviceLoader exists for."""
    import torch_xla.distributed.parallel_loader as pl

    loader = DataLoader(FailsAt(25), batch_size=4)
    steps = sum(1 for _ in pl.MpDeviceLoader(loader, device))
    assert steps == 6 < len(loader) == 10  # no exception: the epoch just ended early


def test_strict_device_loader_raises_the_host_error(device):
    loader = DataLoader(FailsAt(25), batch_size=4)
    steps = 0
    with pytest.raises(D.DataError, match="sample 25: broken"):
        for _ in StrictDeviceLoader(loader, device):
            steps += 1
    assert steps <= 6


def test_strict_device_loader_full_epoch_and_break(device):
    loader = DataLoader(FailsAt(None), batch_size=8)
    batches = [y.cpu().tolist() for _, y in StrictDeviceLoader(loader, device)]
    assert batches == [list(range(i, i + 8)) for i in range(0, 40, 8)]
    strict = StrictDeviceLoader(loader, device)
    for i, _ in enumerate(strict):
        if i == 1:
            break  # stopping early is allowed and closes the background threads
    assert len(list(strict)) == 5  # and the loader can be iterated again


def test_eval_loader_through_strict_loader_keeps_index_and_mask(device):
    ds = D.ArrayDataset(np.arange(10, dtype=np.float32)[:, None], np.arange(10) % 2)
    rows = []
    for x, _y, index, mask in StrictDeviceLoader(D.make_eval_loader(ds, 4, world_size=1,
                                                                   rank=0), device):
        assert x.shape == (4, 1) and str(x.device).startswith("xla")
        rows += index.cpu()[mask.cpu()].tolist()
    assert rows == list(range(10))


def test_loops_run_the_same_steps_without_recompiling(device):
    from tpu_helpers.models import DigitsCNN

    x, y = D.load_digits("test")
    loader = DataLoader(D.ArrayDataset(x, y, 10), batch_size=32, drop_last=True)
    torch.manual_seed(0)
    step = sgd_step(DigitsCNN().to(device))
    assert naive_loop(loader, step, device, max_steps=3) == 3
    assert device_loader_loop(loader, step, device, max_steps=3) == 3
    rows = compare_loops(loader, step, device, steps=4, rounds=1)
    assert [r.name for r in rows] == ["naive .to(device)", "MpDeviceLoader",
                                      "on device (ceiling)"]
    for r in rows:
        assert r.steps == 4 and r.compiles == 0 and r.steps_per_s > 0
    naive, mp, ceiling = rows
    # naive copies x and y separately per step; MpDeviceLoader batches its copies
    assert naive.transfers_to_device >= 2 * 4 + ceiling.transfers_to_device - 1
    assert mp.transfers_to_device < naive.transfers_to_device
