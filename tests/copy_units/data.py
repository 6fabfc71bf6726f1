# copies: data.py
# Train and padded eval loaders for 2 replicas (both take the GLOBAL batch); an odd item is a
# DataError naming its index.
import numpy as np, torch
from data import ArrayDataset, DataError, make_eval_loader, make_train_loader
ds = ArrayDataset(np.arange(50 * 3, dtype=np.float32).reshape(50, 3), np.arange(50) % 4)
train = [i for r in range(2) for i in make_train_loader(ds, 10, world_size=2, rank=r).sampler]
assert sorted(train) == list(range(50))  # 25 each: every index exactly once
seen = []
for r in range(2):
    for x, _y, index, mask in make_eval_loader(ds, 16, world_size=2, rank=r):
        assert x.shape == (8, 3) and (index[~mask] == -1).all()
        seen += index[mask].tolist()
assert sorted(seen) == list(range(50))  # 4 batches of 8 per replica, 14 rows padding
class OddItem(torch.utils.data.Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return torch.zeros(3 if i == 7 else 4), torch.tensor(0)
try:
    list(make_eval_loader(OddItem(), 4, world_size=1, rank=0))
    raise AssertionError("expected a DataError")
except DataError as exc:
    assert "dataset index 7" in str(exc), exc
print("ok")
