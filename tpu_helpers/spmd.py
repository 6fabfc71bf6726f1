"""SPMD: a device mesh over every device the runtime sees (its shape checked, the shapes that
fit listed), a tensor's sharding annotation, where each shard lives and the bytes each device
holds (:func:`sharding_summary`, read from the annotation: nothing is copied), and jax's
lowering set for torch_xla's partitioner. Taught in notebook 07 (notebook 10 reads the bytes
per device too); notebooks 02 (through ``course/loader_experiments.py``), 10 and 12 use
:func:`device_mesh`. Sharded checkpoints are their own unit: ``sharded_checkpoint.py``. Copy
this file alone; importing it starts no XLA runtime (call the runtime functions after
``xr.use_spmd()``)."""

import dataclasses
import importlib.util
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class ShardPlacement:
    """``tensor[index]`` lives on ``device``, which allocates ``padded_shape`` (padded)."""

    device: int
    index: tuple[slice, ...]
    padded_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``index`` as ``(start, stop)`` pairs (hashable, unlike slices before 3.12)."""
        return tuple((s.start, s.stop) for s in self.index)


_TILED = re.compile(r"^\{devices=\[([\d,]+)\](.*?)( last_tile_dim_replicate)?\}$")
_IOTA = re.compile(r"^<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def shard_placements(spec: str, shape: Sequence[int], num_devices: int) -> list[ShardPlacement]:
    """Which slice of a tensor of ``shape`` each device holds, ordered by device (pure).
    ``spec``: :func:`sharding_spec` of the tensor, tiled, replicated or ``""``."""
    shape = tuple(int(s) for s in shape)
    if spec in ("", "{replicated}"):
        return [ShardPlacement(d, tuple(slice(0, n) for n in shape), shape)
                for d in range(num_devices)]
    m = _TILED.match(spec)
    if not m:
        raise ValueError(f"sharding {spec!r} is not tiled or replicated")
    dims = [int(d) for d in m.group(1).split(",")]
    tile_dims = dims[:-1] if m.group(3) else dims
    if len(tile_dims) != len(shape):
        raise ValueError(f"sharding {spec!r} tiles {len(tile_dims)} dims of shape {shape}")
    iota = _IOTA.match(m.group(2))
    if iota:  # XLA's compact "iota" form: <=[4] or <=[2,2]T(1,0)
        base = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(math.prod(base)).reshape(base)
        if iota.group(2):
            ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
    else:
        ids = np.array([int(d) for d in m.group(2).split(",")])
    if ids.size != math.prod(dims):
        raise ValueError(f"sharding {spec!r}: {ids.size} device ids for tiles {dims}")
    tiles = ids.reshape(dims)
    padded = tuple(-(-n // t) for n, t in zip(shape, tile_dims, strict=True))
    out = []
    for tile in np.ndindex(*tile_dims):
        index = tuple(slice(min(i * p, n), min((i + 1) * p, n))
                      for i, p, n in zip(tile, padded, shape, strict=True))
        out += [ShardPlacement(int(d), index, padded) for d in np.ravel(tiles[tile])]
    if sorted(p.device for p in out) != list(range(len(out))):
        raise ValueError(f"sharding {spec!r} does not place each of {len(out)} devices once")
    if len(out) != num_devices:
        raise ValueError(f"sharding {spec!r} uses {len(out)} devices, not {num_devices}")
    return sorted(out, key=lambda p: p.device)


def tensor_placements(t: torch.Tensor) -> list[ShardPlacement]:
    """:func:`shard_placements` of a tensor, from its sharding annotation (no data moves)."""
    return shard_placements(sharding_spec(t), t.shape, xr.global_runtime_device_count())


def sharding_summary(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> list[dict[str, Any]]:
    """A row per tensor (or parameter): ``copies`` (devices holding each element), ``bytes``,
    ``bytes/device`` (padded shard), ``fraction``; ``pd.DataFrame(rows)`` makes a table."""
    named = (tensors.named_parameters() if isinstance(tensors, torch.nn.Module)
             else tensors.items())
    rows = []
    for name, t in named:
        places = tensor_placements(t)
        total = t.numel() * t.element_size()
        per_device = max(math.prod(p.padded_shape) for p in places) * t.element_size()
        rows.append({"tensor": name, "shape": tuple(t.shape),
                     "dtype": str(t.dtype).removeprefix("torch."),
                     "sharding": sharding_spec(t) or "(none: replicated)",
                     "copies": len(places) // len({p.bounds for p in places}), "bytes": total,
                     "bytes/device": per_device, "fraction": per_device / total if total else 1.0})
    return rows
