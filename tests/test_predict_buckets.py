"""predict over length buckets (tpu_helpers.buckets' eval loader): dict batches ``tokens``,
``mask``, ``index`` with index -1 on padding rows. Every sample scored exactly once, in
dataset order, one compile per bucket; in one process and in 3 real processes (gloo), and bad
dict batches are errors naming the batch before anything compiles. predict.py does not import
buckets.py: it reads the batches' keys (each copy unit still stands alone)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, gloo_ranks, run_python

COMMON = """
import numpy as np, torch
import torch.nn.functional as F
from course.text import TinyGPT
from tpu_helpers.buckets import BucketDataset, BucketEvalSampler, collate

BOUNDS, N, PER_REPLICA_BATCH = (16, 32, 64), 53, 4  # rows one replica loads per step

class Scorer(torch.nn.Module):
    '''Per sample: (summed next-token loss over real tokens, count) -> [B, 2].'''
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lm = TinyGPT(d=32, layers=1, heads=2, max_len=64)
    def forward(self, tokens, mask):
        logits = self.lm(tokens)[:, :-1]
        nll = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        real = mask[:, 1:].to(nll.dtype)
        return torch.stack([(nll * real).sum(1), real.sum(1)], 1)

rng = np.random.default_rng(0)
samples = [rng.integers(1, 256, size=int(k)) for k in rng.integers(2, 65, size=N)]
data = BucketDataset(samples, BOUNDS, vocab_size=256)

def loader(world=1, rank=0):  # the sampler takes the global batch
    return torch.utils.data.DataLoader(data, batch_sampler=BucketEvalSampler(
        data.buckets, PER_REPLICA_BATCH * world, num_replicas=world, rank=rank),
        collate_fn=collate)

def expected():
    model = Scorer().eval()
    with torch.no_grad():  # one sample at a time, unpadded
        return np.concatenate([model(torch.as_tensor(s)[None], torch.ones(1, len(s),
                               dtype=torch.bool)).numpy() for s in samples])
"""

ONE = COMMON + """
import json, torch_xla
from tpu_helpers.ordering import PredictionError
from tpu_helpers.predict import predict
model = Scorer().to(torch_xla.device())
pred = predict(model, loader(), len(data))
err = (np.abs(pred.values - expected()).max())
report = {"index": pred.index.tolist(), "compiles": pred.compiles, "err": float(err),
          "padding": pred.padding_rows, "buckets": len(set(data.buckets.tolist()))}
bad = list(loader())
b = dict(bad[2]); b["mask"] = b["mask"].int()
try:
    predict(model, bad[:2] + [b] + bad[3:], len(data))
except PredictionError as e:
    report["bad"] = str(e)
print("REPORT" + json.dumps(report))
"""


def test_predict_scores_bucketed_samples_once_in_order_one_compile_per_bucket():
    out = run_python(ONE, env={"PJRT_DEVICE": "CPU"}).stdout
    report = json.loads(out.split("REPORT")[1])
    print({k: v for k, v in report.items() if k != "index"})
    assert report["index"] == list(range(53))
    assert report["err"] < 1e-4
    assert report["compiles"] == report["buckets"] == 3
    assert report["padding"] > 0  # the buckets' last batches were filled with -1 rows
    assert report["bad"].startswith("batch 2:") and "mask bool" in report["bad"]


WORKER = COMMON + """
import json, os, sys
import torch.distributed as dist, torch_xla
from tpu_helpers.predict import PredictOptions, TorchDistributedReplicas, predict
rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "init"),
                        rank=rank, world_size=world)
model = Scorer().to(torch_xla.device())
opts = PredictOptions(backend=TorchDistributedReplicas(), all_ranks=True)
pred = predict(model, loader(world, rank), len(data), opts)
widths = [b["tokens"].shape[1] for b in loader(world, rank)]
np.save(f"{out}/values-{rank}.npy", pred.values)
json.dump({"index": pred.index.tolist(), "compiles": pred.compiles, "widths": widths,
           "padding": pred.padding_rows, "err": float(np.abs(pred.values - expected()).max())},
          open(f"{out}/report-{rank}.json", "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_three_processes_score_bucketed_samples_exactly_once(tmp_path):
    world = 3
    reports = gloo_ranks(WORKER, world, tmp_path)
    print([{k: v for k, v in r.items() if k != "index"} for r in reports])
    assert all(r["widths"] == reports[0]["widths"] for r in reports)  # same bucket per step
    assert sorted(set(reports[0]["widths"])) == [16, 32, 64]
    for r in reports:
        assert r["index"] == list(range(53)) and r["err"] < 1e-4
        assert r["compiles"] == 3  # one graph per bucket
    # each step holds PER_REPLICA_BATCH x world rows; each bucket's last step ends in padding
    steps = len(reports[0]["widths"])
    assert reports[0]["padding"] == steps * 4 * world - 53
    np.testing.assert_array_equal(np.load(tmp_path / "values-1.npy"),
                                  np.load(tmp_path / "values-0.npy"))


def test_predict_and_train_do_not_import_buckets():
    for name in ("predict.py", "train.py"):
        text = (REPO / "tpu_helpers" / name).read_text()
        assert "import buckets" not in text and "from .buckets" not in text, name
