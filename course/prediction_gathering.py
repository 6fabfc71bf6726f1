"""Course code for ``notebooks/04_prediction_gathering.ipynb`` (course only, not the toolkit): the
reference model trained in plain PyTorch on the CPU, the table of what each gathering method
returns on the master, and the confusion-matrix plot."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from course.models import DigitsCNN
from tpu_helpers.ordering import exactly_once

#: The methods whose master keeps only its own rows (no gather).
OWN_ROWS = ("article's loop (no sampler)", "DistributedSampler, master keeps its own")


def train_cpu_model(x: np.ndarray, y: np.ndarray, steps: int, batch: int, lr: float,
                    seed: int) -> tuple[DigitsCNN, float]:
    """A ``DigitsCNN`` trained briefly with AdamW on the CPU (random batches); (model in eval
    mode, final loss)."""
    torch.manual_seed(seed)
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    gen = torch.Generator().manual_seed(seed)
    for _step in range(steps):
        rows = torch.randint(0, len(xs), (batch,), generator=gen)
        loss = F.cross_entropy(model(xs[rows]), ys[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), loss.item()


def master_result(method: str, shards: list[np.ndarray], n: int,
                  forward: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(dataset rows, predictions) the master ends up with; concatenating the shards in rank order
    is what ``xm.all_gather`` hands it."""
    if method in OWN_ROWS:
        return shards[0], forward(shards[0])             # the master's own loop
    index = np.concatenate(shards)
    if method.startswith("index + mask"):
        ordered = exactly_once(index, index >= 0, forward(np.maximum(index, 0)), n=n)
        return ordered.index, ordered.values
    return index, forward(index)


def symptoms(method: str, n: int, shards: list[np.ndarray], forward, labels: np.ndarray,
             batch: int) -> dict:
    """What a user sees on the master for one method and dataset length, scored position by
    position, and the batch shapes each replica runs."""
    rows, preds = master_result(method, shards, n, forward)
    shapes = [tuple(min(batch, len(s) - i) for i in range(0, len(s), batch)) for s in shards]
    k = min(len(preds), n)
    return {"method": method, "n": n, "rows per replica": max(len(s) for s in shards),
            "rows returned": len(rows), "duplicates": len(rows) - len(np.unique(rows)),
            "missing": n - len(np.intersect1d(rows, np.arange(n))),
            "in dataset order": bool(np.array_equal(rows, np.arange(n))),
            "accuracy as scored": round(float((preds[:k].argmax(1) == labels[:k]).mean()), 3),
            "batch shapes": sorted({b for s in shapes for b in s}),
            "same steps+shapes on all replicas": len(set(shapes)) == 1}


def symptom_table(methods, sizes, replica_rows, world: int, forward, labels: np.ndarray,
                  batch: int) -> pd.DataFrame:
    """:func:`symptoms` for every method and size, indexed by (n, method); ``replica_rows(method,
    n, rank)`` gives the rows replica ``rank`` of ``world`` predicts."""
    return pd.DataFrame([
        symptoms(m, n, [replica_rows(m, n, r) for r in range(world)], forward, labels, batch)
        for n in sizes for m in methods]).set_index(["n", "method"])


def plot_confusion(labels: np.ndarray, predicted: np.ndarray) -> None:
    """A 10 x 10 confusion matrix of digits, counts written in the cells."""
    import matplotlib.pyplot as plt

    confusion = pd.crosstab(labels, predicted).reindex(
        index=range(10), columns=range(10), fill_value=0).to_numpy()
    fig, ax = plt.subplots(figsize=(5, 4.4))
    ax.imshow(confusion, cmap="Blues")
    for (i, j), v in np.ndenumerate(confusion):
        if v:
            ax.text(j, i, v, ha="center", va="center", fontsize=8,
                    color="white" if v > confusion.max() / 2 else "black")
    ax.set(xticks=range(10), yticks=range(10), xlabel="predicted", ylabel="label",
           title=f"Gathered predictions: {np.trace(confusion)} of {len(labels)} test digits right")
    plt.show()
