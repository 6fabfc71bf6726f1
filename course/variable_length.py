"""Notebook 09's plumbing: padding, timing the steps, the tables and the figures."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met


def compiles() -> int:
    """XLA compilations so far in this process (torch_xla's ``CompileTime`` counter)."""
    return (met.metric_data("CompileTime") or [0])[0]  # [count, total ns, samples]


def pad(rows: Sequence[Sequence[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded with 0 to ``width``: tokens [B, width] and the real-token mask."""
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.as_tensor(row)
    return tokens, tokens != 0


def take_per_bucket(loader: Iterable[dict],
                    per_bucket: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``per_bucket`` batches of each bucket (padded length) the loader yields."""
    taken: list[tuple[torch.Tensor, torch.Tensor]] = []
    for batch in loader:
        tokens, mask = batch["tokens"], batch["mask"]
        if sum(t.shape[1] == tokens.shape[1] for t, _ in taken) < per_bucket:
            taken.append((tokens, mask))
    return taken


def time_steps(step: Callable, batches, device) -> np.ndarray:
    """Run ``step(tokens, mask)`` on each batch, each timed to the end of its execution: per step
    (compiled?, seconds, real tokens, token slots)."""
    rows = []
    for tokens, mask in batches:
        before, start = compiles(), time.perf_counter()
        step(tokens.to(device), mask.to(device))
        xm.wait_device_ops()
        rows.append((compiles() > before, time.perf_counter() - start,
                     int(mask.sum()), mask.numel()))
    return np.array(rows)


def summarize(runs: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per strategy: compiles, padding share, real tokens/s with and without the compiling steps;
    prints one line each."""
    summary = {}
    for name, r in runs.items():
        warm = r[r[:, 0] == 0]  # steps that did not compile
        s = summary[name] = dict(
            compiles=int(r[:, 0].sum()), padding=1 - r[:, 2].sum() / r[:, 3].sum(),
            tok_s=r[:, 2].sum() / r[:, 1].sum(),
            warm_tok_s=warm[:, 2].sum() / warm[:, 1].sum() if len(warm) else float("nan"))
        print(f"{name:22s} compiles {s['compiles']:2d}  padding {s['padding']:.0%}  real tokens/s "
              f"{s['tok_s']:7.0f} (compiles included), {s['warm_tok_s']:7.0f} (warm steps)")
    return summary


def plot_strategies(summary: dict[str, dict[str, float]]) -> None:
    """Compiles, padding share and warm real tokens/s of each padding strategy, side by side."""
    names = [n.split(" ", 1)[0] for n in summary]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3))
    panels = [("compiles", "XLA compiles"), ("padding", "padding share of token slots"),
              ("warm_tok_s", "real tokens/s, warm steps")]
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.bar(names, [np.nan_to_num(s[key]) for s in summary.values()], color=["C3", "C1", "C2"])
        ax.set_title(label)
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    _, b, c = summary.values()
    fig.suptitle(f"Buckets: {c['compiles']} compiles, {c['padding']:.0%} padding, "
                 f"{c['warm_tok_s'] / b['warm_tok_s']:.1f}x the real tokens/s of pad-to-max")
    fig.tight_layout()
    plt.show()


def plot_curves(curves: dict[str, np.ndarray], gap_autocast: float, gap_pure: float) -> None:
    """The training loss of each precision, titled with the gaps to float32."""
    fig, ax = plt.subplots(figsize=(6, 3))
    for name, curve in curves.items():
        ax.plot(curve, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    steps = len(next(iter(curves.values())))
    ax.set_title(f"Autocast tracks float32 ({gap_autocast:+.2f}); pure bf16 weights: "
                 f"{gap_pure:+.2f} after {steps} steps")
    ax.legend()
    plt.show()
