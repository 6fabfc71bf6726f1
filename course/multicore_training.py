"""Course code for ``notebooks/03_multicore_training.ipynb`` (course only, not the toolkit): the
held-out accuracy of a checkpoint in plain PyTorch on the CPU, and the plot of how far the SPMD
run's weights drift from the launched run's."""

from __future__ import annotations

import numpy as np
import torch

from course.models import DigitsCNN


def held_out_accuracy(state: dict[str, torch.Tensor], x: np.ndarray, y: np.ndarray) -> float:
    """A ``DigitsCNN`` with weights ``state``, evaluated on ``(x, y)`` on the CPU."""
    model = DigitsCNN().eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def plot_gap(gap) -> None:
    """``gap``: a pandas Series of max |w_spmd - w_launch| indexed by step, on a log axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(gap.index, gap.values, "o-")
    ax.set(xlabel="step", ylabel="max abs weight difference", yscale="log",
           title=f"SPMD vs launch: weights differ by {gap.iloc[-1]:.0e} after {gap.index[-1]} "
                 f"steps (max {gap.max():.0e})")
    plt.show()
