# copies: buckets.py
# Variable-length samples in length buckets: two replicas, same bucket per step, eval once.
import numpy as np
from buckets import BucketDataset, BucketError, BucketEvalSampler, BucketSampler, collate
from torch.utils.data import DataLoader

rng = np.random.default_rng(0)
samples = [rng.integers(1, 256, size=n) for n in rng.integers(1, 129, size=200)]
data = BucketDataset(samples, (32, 64, 128), vocab_size=256)
plans = [[len(b) for b in BucketSampler(data.buckets, 8, num_replicas=2, rank=r)]
         for r in range(2)]
assert plans[0] == plans[1] and set(plans[0]) == {4}  # global batch 8: 4 rows per replica
widths = [[b["tokens"].shape[1] for b in DataLoader(
    data, batch_sampler=BucketSampler(data.buckets, 8, num_replicas=2, rank=r),
    collate_fn=collate)] for r in range(2)]
assert widths[0] == widths[1] and set(widths[0]) == {32, 64, 128}
seen = [i for r in range(2) for b in DataLoader(
    data, batch_sampler=BucketEvalSampler(data.buckets, 8, num_replicas=2, rank=r),
    collate_fn=collate) for i in b["index"].tolist() if i >= 0]
assert sorted(seen) == list(range(200))
try:
    BucketDataset([[1, 2], [3] * 129], (32, 64, 128))
except BucketError as err:
    assert "sample 1 has 129 tokens" in str(err)
else:
    raise AssertionError("a too-long sample passed")
print("ok")
