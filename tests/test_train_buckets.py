"""fit/train over length buckets: a loaders_fn giving dict batches (tokens, mask, index from
tpu_helpers.buckets) trains a tiny causal LM under torch_xla.launch on XLA:CPU; the eval
loader's padding rows (index -1) add nothing; compiles stop after one graph per bucket. The
(x, y) path is unchanged (tests/test_train*.py)."""

from __future__ import annotations

import json

from conftest import run_script

SCRIPT = '''
import json, sys
import numpy as np, torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from course.text import TinyGPT
from tpu_helpers.buckets import BucketDataset, BucketEvalSampler, BucketSampler, collate
from tpu_helpers.train import Config, train

BOUNDS = (16, 32, 64)

class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = TinyGPT(d=32, layers=1, heads=2, max_len=64)
    def forward(self, tokens, mask):
        return self.lm(tokens)

def lm_loss(logits, batch):
    """Mean next-token loss over real tokens; (loss, correct, count)."""
    target, real = batch["tokens"][:, 1:], batch["mask"][:, 1:]
    logits = logits[:, :-1]
    nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    count = real.sum()
    correct = ((logits.argmax(-1) == target) & real).sum()
    return (nll * real).sum() / count.clamp(min=1), correct, count

def loaders(train_set, eval_set, config, world, rank):  # the samplers split the global batch
    train = DataLoader(train_set, collate_fn=collate, batch_sampler=BucketSampler(
        train_set.buckets, config.global_batch, num_replicas=world, rank=rank, seed=config.seed))
    ev = DataLoader(eval_set, collate_fn=collate, batch_sampler=BucketEvalSampler(
        eval_set.buckets, config.global_batch, num_replicas=world, rank=rank))
    return train, ev

def samples(n, seed):  # a learnable pattern: runs of one byte, lengths 2..64
    rng = np.random.default_rng(seed)
    return [np.repeat(rng.integers(1, 256, size=(k + 3) // 4), 4)[:k]
            for k in rng.integers(2, 65, size=n)]

if __name__ == "__main__":
    train_set, eval_set = (BucketDataset(samples(n, s), BOUNDS) for n, s in ((96, 0), (37, 1)))
    h = train(Config(epochs=3, global_batch=8, lr=1e-2, log_every=1, out_dir=sys.argv[1]),
              train_set, LM, eval_data=eval_set, loss_fn=lm_loss, loaders_fn=loaders)
    real = sum(len(s) - 1 for s in eval_set.samples)
    steps = len(loaders(train_set, eval_set, Config(global_batch=8), 1, 0)[0])
    print("REPORT" + json.dumps({"epochs": h["epochs"], "real": real, "steps": steps}))
'''


def test_fit_trains_on_length_buckets_compiles_once_per_bucket(tmp_path):
    proc = run_script(tmp_path, "bucket_train.py", SCRIPT, str(tmp_path / "run"), timeout=400)
    report = json.loads(proc.stdout.split("REPORT")[1])
    epochs = report["epochs"]
    print([{k: e[k] for k in ("steps", "train_loss", "eval_loss", "eval_acc", "eval_count",
                              "compiles")} for e in epochs])
    assert [e["steps"] for e in epochs] == [report["steps"]] * 3
    assert epochs[0]["eval_count"] == report["real"]  # every real token once, padding rows none
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert epochs[-1]["eval_loss"] < epochs[0]["eval_loss"]
    assert epochs[1]["compiles"] == epochs[2]["compiles"] == 0  # warm: no new length
