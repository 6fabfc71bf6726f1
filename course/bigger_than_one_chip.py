"""Notebook 10's figures (bytes per device before and after FSDPv2, scan against depth), and
its ``bytes_per_device`` for notebook 12's script."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def bytes_per_device(model) -> list[int]:
    """Per device, the bytes of the model's parameter shards in its buffers (notebook 10,
    section 3; each shard is copied to the host: for a small model)."""
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    held = np.zeros(xr.global_runtime_device_count(), dtype=np.int64)
    for p in model.parameters():
        for shard in xs.XLAShardedTensor(p).local_shards:
            held[int(shard.shard_device.split(":")[-1])] += shard.data.nbytes
    return held.tolist()


def plot_bytes_per_device(before: np.ndarray, after: np.ndarray, total: int) -> None:
    """Parameter bytes per device, replicated (data parallel) beside FSDPv2."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ticks = np.arange(len(before))
    ax.bar(ticks - 0.2, before / 1e3, 0.4, label="replicated (data parallel)", color="C1")
    ax.bar(ticks + 0.2, after / 1e3, 0.4, label="FSDPv2", color="C2")
    ax.set_xticks(ticks, [f"device {d}" for d in ticks])
    ax.set_ylabel("parameter kB in the device's buffers")
    ax.set_title(f"FSDPv2 over {len(before)} devices: each holds {after.max() / total:.0%} of the "
                 f"{total / 1e3:.0f} kB model")
    ax.legend()
    plt.show()


def plot_scan_costs(costs: Mapping[tuple[str, int], tuple], depths: Sequence[int],
                    growth: Mapping[str, float], runtime: str) -> None:
    """Operations in the forward program and compile seconds per depth, loop against scan.

    ``costs[name, depth]`` is ``(operations, compile seconds, ...)`` for name "loop" and "scan".
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    for name, color in (("loop", "C3"), ("scan", "C2")):
        for k in (0, 1):
            axes[k].plot(depths, [costs[name, d][k] for d in depths], "o-", color=color,
                         label=name)
    axes[0].set_ylabel("operations in the forward program")
    axes[1].set_ylabel("compile seconds (XLA:CPU)" if runtime != "TPU" else "compile seconds")
    for ax in axes:
        ax.set_xlabel("blocks")
        ax.legend()
    fig.suptitle(f"The unrolled loop's program grows x{growth['loop']:.1f} from {depths[0]} to "
                 f"{depths[-1]} blocks, scan's x{growth['scan']:.1f}")
    fig.tight_layout()
    plt.show()
