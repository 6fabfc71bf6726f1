"""Meshes for the devices you have: SPMD data parallel and model sharding.

Taught in ``notebooks/07_model_sharding_spmd.ipynb``; ``notebooks/03`` and ``04`` use
:func:`device_mesh` for SPMD data parallelism on 4 virtual XLA:CPU devices.

Call :func:`device_mesh` only after ``xr.use_spmd()`` (it asks the runtime how many
devices there are, which starts the runtime).
"""

from __future__ import annotations

import math

import numpy as np


def device_mesh(axis_names: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None):
    """A ``xs.Mesh`` over every addressable device.

    ``shape`` defaults to all devices on the first axis and 1 on the others, e.g.
    ``device_mesh(("data", "model"))`` on 4 devices is a (4, 1) mesh. A ``-1`` entry is
    inferred. Raises ValueError (before any compile) if the shape does not use exactly
    the available devices.
    """
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    if shape is None:
        shape = (n,) + (1,) * (len(axis_names) - 1)
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(n // known if s == -1 else s for s in shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but names {axis_names}")
    if math.prod(shape) != n:
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices; {n} are available")
    return xs.Mesh(np.arange(n), shape, axis_names)
