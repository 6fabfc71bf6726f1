"""SPMD: a device mesh over every device the runtime sees (its shape checked, the shapes that
fit listed), a tensor's sharding annotation, and jax's lowering set for torch_xla's partitioner.
Taught in notebook 07; notebooks 02 (through ``course/loader_experiments.py``), 10 and 12 use
:func:`device_mesh`. Where each shard lives (``sharding_summary``) and sharded checkpoints, used
by notebook 07 only, are in ``course/sharding.py`` (issue 28). Copy this file alone; importing
it starts no XLA runtime (call the runtime functions after ``xr.use_spmd()``)."""

import importlib.util
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr


def mesh_shapes(num_devices: int, num_axes: int) -> list[tuple[int, ...]]:
    """Every shape of ``num_axes`` axes whose sizes multiply to ``num_devices``."""
    if num_devices < 1 or num_axes < 1:
        raise ValueError(f"need num_devices, num_axes >= 1, got {num_devices}, {num_axes}")
    if num_axes == 1:
        return [(num_devices,)]
    return [(d, *rest) for d in range(1, num_devices + 1) if num_devices % d == 0
            for rest in mesh_shapes(num_devices // d, num_axes - 1)]


def resolve_mesh_shape(num_devices: int, axis_names: Sequence[str],
                       shape: Sequence[int] | None = None) -> tuple[int, ...]:
    """Check a mesh shape against the device count (pure): default all devices on the
    first axis, one ``-1`` inferred; the ValueError lists the shapes that fit."""
    names = tuple(axis_names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"axis names must be distinct and non-empty, got {names}")
    if shape is None:
        return (num_devices,) + (1,) * (len(names) - 1)
    shape = tuple(int(s) for s in shape)
    known = math.prod(s for s in shape if s != -1)
    if len(shape) != len(names):
        problem = f"has {len(shape)} axes but names {names}"
    elif shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        problem = "sizes must be >= 1 (at most one -1)"
    elif -1 in shape and num_devices % known:
        problem = f"{num_devices} devices do not divide by {known}"
    elif -1 not in shape and known != num_devices:
        problem = f"needs {known} devices; {num_devices} are available"
    else:
        return tuple(num_devices // known if s == -1 else s for s in shape)
    fits = ", ".join(str(s) for s in mesh_shapes(num_devices, len(names)))
    raise ValueError(f"mesh shape {shape}: {problem}; shapes for {num_devices} devices and "
                     f"axes {names}: {fits}")


def device_mesh(axis_names: tuple[str, ...] = ("data",),
                shape: tuple[int, ...] | None = None) -> xs.Mesh:
    """An ``xs.Mesh`` over every device the SPMD runtime sees (all hosts of a slice), shape
    checked by :func:`resolve_mesh_shape`: ``(("fsdp", "model"), (-1, 2))`` on 4 is (2, 2)."""
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), resolve_mesh_shape(n, axis_names, shape), tuple(axis_names))


def jax_lowers_for_gspmd() -> str:
    """Make jax lower its sharding ops for torch_xla's partitioner (GSPMD), as torch_xla 2.9 does
    when it imports jax (``maybe_get_jax``, ``_internal/jax_workarounds.py`` v2.9.0). 2.8 does
    not: with jax 0.7.2 (Shardy by default; Kaggle) ``xs.shard_as``, so the backward of ``scan``
    / ``scan_layers`` under SPMD, fails in XLA's partitioner ("Side-effect HLO must have sharding
    ... xla.sdy.ShardingGroup"). Call it after ``xr.use_spmd()``; returns what it did."""
    if importlib.util.find_spec("jax") is None:
        return "jax is not installed: nothing to do"
    xr.global_runtime_device_count()  # torch_xla opens its devices before jax is imported
    import jax

    before = bool(jax.config.jax_use_shardy_partitioner)
    jax.config.update("jax_use_shardy_partitioner", False)
    return (f"jax {jax.__version__}: jax_use_shardy_partitioner "
            f"{'True -> False' if before else 'was already False'}")


def sharding_spec(t: torch.Tensor) -> str:
    """XLA's sharding annotation of ``t``: ``""`` or ``{replicated}``: every device holds it."""
    return xs.XLAShardedTensor(t).sharding_spec if t.device.type == "xla" else ""
