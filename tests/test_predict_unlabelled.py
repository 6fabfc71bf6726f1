"""Prediction without labels, as a competition's test file has none: ``make_eval_loader`` and
``predict`` take items that are a tensor, a 1-tuple, a dict or a numpy array, as well as
``(x, y)``; every row comes back once, in dataset order, so the user's ids line up. World size
1 in this process (real torch_xla), 8 here and 3 in ``test_predict_multiprocess.py`` as real
processes joined by gloo (XLA:CPU has no cross-process XLA collectives:
``TorchDistributedReplicas`` stands in for ``xm.all_gather``).
Bad input is named by its dataset index before a compile."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import gloo_ranks
from torch.utils.data import Dataset

from tpu_helpers.data import DataError, make_eval_loader, make_loaders
from tpu_helpers.predict import predict
from tpu_helpers.train import Config

N, FEATURES = 37, 5


class Items(Dataset):
    """``N`` rows of features; each item shaped as ``kind`` says (a user's Dataset)."""

    def __init__(self, kind: str, odd: dict[int, object] | None = None) -> None:
        self.kind, self.odd = kind, odd or {}
        self.x = torch.randn(N, FEATURES, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if i in self.odd:
            return self.odd[i]
        x = self.x[i]
        return {"tensor": x, "tuple": (x,), "dict": {"features": x}, "numpy": x.numpy(),
                "pair": (x, i % 3)}[self.kind]


class Net(torch.nn.Module):
    """Takes a tensor, or the dict a dict item collates to."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, 3)

    def forward(self, x):
        return self.linear(x["features"] if isinstance(x, dict) else x)


@pytest.fixture(scope="module")
def net_and_reference():
    import torch_xla

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        reference = net(Items("tensor").x).numpy()
    return net.to(torch_xla.device()), reference


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "numpy", "pair"])
def test_every_item_layout_comes_back_once_in_order(kind, net_and_reference):
    net, reference = net_and_reference
    loader = make_eval_loader(Items(kind), 8)
    first = next(iter(loader))
    assert len(first) == (4 if kind == "pair" else 3)  # (x[, y], index, mask)
    pred = predict(net, loader)
    print(f"{kind}: {len(pred.index)} rows, {pred.padding_rows} padding, "
          f"max |diff| {np.abs(pred.values - reference).max():.2e}")
    assert pred.index.tolist() == list(range(N)) and pred.duplicates == 0
    assert pred.padding_rows == -N % 8
    np.testing.assert_allclose(pred.values, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,odd,named", [
    ("tensor", {13: torch.zeros(FEATURES + 1)}, r"dataset index 13: x has shape \[6\]"),
    ("tensor", {20: (torch.zeros(FEATURES), 1)}, "dataset index 20: the item has"),
    ("pair", {9: torch.zeros(FEATURES)}, "dataset index 9: the item has"),
    ("dict", {30: {"features": torch.zeros(2)}}, "dataset index 30: x has"),
])
def test_mixed_items_are_named_by_dataset_index(kind, odd, named, net_and_reference):
    with pytest.raises(DataError, match=named):
        predict(net_and_reference[0], make_eval_loader(Items(kind, odd), 8))


@pytest.mark.parametrize("which", ["training", "evaluation"])
def test_training_or_evaluating_unlabelled_items_is_refused(which):
    labelled, unlabelled = Items("pair"), Items("tensor")
    sets = (unlabelled, labelled) if which == "training" else (labelled, unlabelled)
    with pytest.raises(DataError, match=f"{which} set: dataset index 0 has 1 field"):
        make_loaders(*sets, Config(global_batch=8, eval_global_batch=8), 1, 0)


# A competition's unlabelled test file, read by a user's Dataset in every rank; the master
# writes the submission file. Rank files and ids: the ids are strings in the file's order.
WORKER = """
import json, os, sys
import numpy as np, pandas as pd, torch, torch.distributed as dist
import torch_xla
from tpu_helpers.checkpoint import atomic_write
from tpu_helpers.data import make_eval_loader
from tpu_helpers.predict import PredictOptions, TorchDistributedReplicas, predict

rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "init"),
                        rank=rank, world_size=world)

class TestFile(torch.utils.data.Dataset):  # no label column
    def __init__(self, path):
        frame = pd.read_csv(path)
        self.ids, self.x = frame.pop("id").to_numpy(), frame.to_numpy(np.float32)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return torch.from_numpy(self.x[i])

test = TestFile(os.path.join(out, "test.csv"))
torch.manual_seed(0)
model = torch.nn.Linear(test.x.shape[1], 3).to(torch_xla.device())
opts = PredictOptions(backend=TorchDistributedReplicas())
pred = predict(model, make_eval_loader(test, 4 * world), options=opts)  # 4 rows per rank
if rank == 0:
    frame = pd.DataFrame({"id": test.ids[pred.index], "score": pred.values[:, 0]})
    atomic_write(os.path.join(out, "submission.csv"), lambda f: frame.to_csv(f, index=False))
json.dump({"rank": rank, "rows": None if pred is None else len(pred.index),
           "compiles": None if pred is None else pred.compiles},
          open(os.path.join(out, f"report-{rank}.json"), "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [8])  # 3 ranks: tests/test_predict_multiprocess.py
def test_unlabelled_test_file_from_every_rank_to_one_submission(world, tmp_path):
    rng = np.random.default_rng(world)
    n = 4 * world * 3 + 5  # three full steps and a padded one
    frame = pd.DataFrame(rng.standard_normal((n, FEATURES)).astype(np.float32),
                         columns=[f"f{k}" for k in range(FEATURES)])
    frame.insert(0, "id", [f"row-{k:05d}" for k in rng.permutation(100_000)[:n]])
    frame.to_csv(tmp_path / "test.csv", index=False)
    reports = gloo_ranks(WORKER, world, tmp_path, timeout=300)
    assert [r["rows"] for r in reports] == [n] + [None] * (world - 1)
    assert reports[0]["compiles"] == 1  # one graph for every batch, padded one included
    submission = pd.read_csv(tmp_path / "submission.csv")
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 3)
    with torch.no_grad():
        features = frame.drop(columns="id").to_numpy(np.float32, copy=True)
        expected = model(torch.from_numpy(features))[:, 0].numpy()
    print(f"world {world}: {len(submission)} rows for {n} ids")
    assert submission["id"].tolist() == frame["id"].tolist()  # each id once, in file order
    np.testing.assert_allclose(submission["score"], expected, rtol=1e-5, atol=1e-5)
