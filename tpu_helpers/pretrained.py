"""Pretrained weights onto the XLA device one tensor at a time: the host never holds the model.

``from_pretrained(...)`` builds the whole model in host memory and ``.to(device)`` copies it,
in every replica: on a TPU host the host runs out first (pytorch/xla issue 6822; measured with
transformers 5.24, which memory-maps the files: 1.35x a 245 MiB model at the peak, ``make bench``).
Instead, build the model on the device (``with torch.device(torch_xla.device()):``; the random
initial values are lazy and never computed, as every weight is overwritten before the
first sync) and stream each tensor of the safetensors files into it: the host holds one tensor
at a time, the file's own pages, handed back to the OS once sent (:func:`stream_to_device`).
Non-persistent buffers (rotary frequencies) come from the model's own ``__init__``, on the device.

Also: :func:`to_mesh` (each tensor straight to its FSDPv2 shards under SPMD), what a training
run holds per chip (:func:`training_bytes`, :func:`saved_activation_bytes`), a LoRA adapter
saved alone from the device (:func:`save_adapter`) and greedy continuations in one graph
(:func:`generate_greedy`). Taught in notebook 14.

Copy it with ``checkpoint.py`` (its atomic file writes); torch, torch_xla and the standard
library otherwise. The safetensors format is read here directly (8 bytes of header length, a JSON
header of names, dtypes, shapes and byte offsets, then raw bytes), so loading a file never runs
code from it. Importing this module does not touch the XLA device.
"""

from __future__ import annotations

import json
import mmap
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

try:  # inside the tpu_helpers package
    from .checkpoint import atomic_write
except ImportError:  # copied next to checkpoint.py (the one helper that writes files)
    from checkpoint import atomic_write  # type: ignore[no-redef]

INDEX = "model.safetensors.index.json"  #: a sharded checkpoint's map: tensor name -> file
SINGLE = "model.safetensors"  #: an unsharded checkpoint
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}  #: safetensors' dtype names


class CheckpointMismatch(ValueError):
    """The checkpoint and the model disagree (a name, a shape): says which, in which file."""


@dataclass
class Streamed:
    """What :func:`stream_to_device` copied: tensors, bytes, the largest tensor, the files."""

    tensors: int = 0
    bytes: int = 0
    largest_bytes: int = 0
    files: list[str] = field(default_factory=list)


def checkpoint_files(folder: str | Path) -> dict[str, list[str]]:
    """File name -> the tensor names it holds, in file order (``save_pretrained``'s layout:
    ``model.safetensors``, or shards listed by ``model.safetensors.index.json``)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return dict(sorted(files.items()))
    if (folder / SINGLE).is_file():
        return {SINGLE: list(read_header(folder / SINGLE)[0])}
    raise FileNotFoundError(f"{folder}: neither {INDEX} nor {SINGLE} (a save_pretrained folder)")


def read_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensors (name -> dtype, shape, data_offsets) and where data starts."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size)) if 0 < size < 1 << 30 else None
    if not isinstance(header, dict):
        raise CheckpointMismatch(f"{path}: not a safetensors file (header length {size})")
    header.pop("__metadata__", None)
    return header, 8 + size


def tensors_of(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file as a view of the file's pages (no copy); the pages a
    tensor used are handed back to the OS when the next one is read."""
    header, start = read_header(path)
    with open(path, "rb") as fh:
        pages = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written back
    done = 0
    for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = (start + o for o in meta["data_offsets"])
        dtype = DTYPES[meta["dtype"]]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        view = torch.frombuffer(pages, dtype=dtype, count=count, offset=begin) if count else \
            torch.empty(0, dtype=dtype)
        yield name, view.reshape(meta["shape"])
        del view
        cut = begin // mmap.PAGESIZE * mmap.PAGESIZE
        if cut > done:
            pages.madvise(mmap.MADV_DONTNEED, done, cut - done)  # read and sent: drop them
            done = cut


def stream_to_device(model: torch.nn.Module, folder: str | Path, *,
                     dtype: torch.dtype | None = None, mesh: xs.Mesh | None = None) -> Streamed:
    """Copy every tensor of the checkpoint in ``folder`` into ``model``'s parameters and
    persistent buffers, where they already are (the XLA device), one tensor at a time.

    Every name in the files must be one of the model's and every one of the model's persistent
    tensors must be in the files (tied weights count once), with the same shape: otherwise
    :class:`CheckpointMismatch`, before anything is copied. ``dtype`` casts on the host first
    (e.g. ``torch.bfloat16``); by default each weight keeps the model's dtype. ``mesh`` (SPMD):
    each tensor goes straight to its FSDPv2 shards (:func:`to_mesh`): no device holds it whole.
    """
    folder, files = Path(folder), checkpoint_files(folder)
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets |= {n: b for n, b in model.named_buffers() if _persistent(model, n)}
    shapes = {}
    for file, names in files.items():
        header = read_header(folder / file)[0]
        for name in names:
            if name not in targets or name not in header:
                raise CheckpointMismatch(f"{folder / file}: {name!r} is not in the "
                                         f"{'file' if name in targets else 'model'}")
            shapes[name] = tuple(header[name]["shape"])
            if shapes[name] != tuple(targets[name].shape):
                raise CheckpointMismatch(
                    f"{folder / file}: {name!r} has shape {list(shapes[name])}, the model's "
                    f"{list(targets[name].shape)}")
    missing = [n for n in targets if n not in shapes and not _tied_to_loaded(model, n, shapes)]
    if missing:
        raise CheckpointMismatch(f"{folder}: no tensor for {missing[:5]}"
                                 f"{' ...' if len(missing) > 5 else ''} ({len(missing)} missing)")
    done = Streamed(files=list(files))
    with torch.no_grad():
        for file in files:
            for name, host in tensors_of(folder / file):  # this one tensor, the file's pages
                target = targets[name]  # its data swapped, the object kept (ties hold):
                host = host.to(dtype or target.dtype)
                target.data = to_mesh(host, mesh) if mesh else host.to(target.device)  # no op
                if target.device.type == "xla":  # the transfer is asynchronous: let it finish,
                    xm.wait_device_ops()  # so the host never queues more than this tensor
                done.tensors, done.bytes = done.tensors + 1, done.bytes + host.nbytes
                done.largest_bytes = max(done.largest_bytes, host.nbytes)
                del host
    return done


def to_mesh(host: torch.Tensor, mesh: xs.Mesh, axis: str = "fsdp") -> torch.Tensor:
    """``host`` on the SPMD device, dim 0 split over the mesh's ``axis``, each device sent only
    its own rows. FSDPv2 keeps a parameter that is already sharded as it is; one it shards itself
    it splits on its largest dimension (``_prepare_spmd_partition_spec(shard_maximal=True)``).

    ``xs.mark_sharding`` (public) would put the whole tensor on the device first and split it
    there, 2-3x the tensor at the peak; torch_xla's private ``_XLAC._global_tensor_from_cpu_shards``
    (used by its own ``_internal/tpu.py``, v2.8.0 and v2.9.0) takes one host slice per device,
    padded to equal rows as XLA pads an uneven split. One host: its devices are the mesh's.
    """
    if xr.process_count() > 1:
        raise NotImplementedError("to_mesh: one host only (its devices are all the mesh's)")
    spec = ((axis,) + (None,) * (host.dim() - 1)) if host.dim() else ()
    axis_of = mesh.get_logical_mesh()  # device id -> its place on `axis`
    place = {int(d): int(i[mesh.axis_names.index(axis)]) for i, d in np.ndenumerate(axis_of)}
    parts = mesh.mesh_shape[mesh.axis_names.index(axis)]
    rows = -(-host.shape[0] // parts) if host.dim() else 0
    slices = []
    for device in range(len(place)):
        if not host.dim():
            slices.append(host)
            continue
        part = host[place[device] * rows:(place[device] + 1) * rows]
        pad = rows - part.shape[0]
        slices.append(torch.cat([part, part.new_zeros(pad, *host.shape[1:])]) if pad else part)
    return torch_xla._XLAC._global_tensor_from_cpu_shards(
        slices, mesh.get_op_sharding(spec), list(host.shape))


def _persistent(model: torch.nn.Module, name: str) -> bool:
    module_name, _, buffer = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buffer not in module._non_persistent_buffers_set  # torch's own record of them


def _tied_to_loaded(model: torch.nn.Module, name: str, loaded: dict) -> bool:
    """A tied weight (``lm_head.weight`` sharing the embedding): loaded under another name."""
    tensor = dict(model.named_parameters(remove_duplicate=False)).get(name)
    return tensor is not None and any(
        other is tensor for n, other in model.named_parameters(remove_duplicate=False)
        if n in loaded)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each tensor once): what a device holds."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.nelement() * t.element_size() for t in seen.values())


@dataclass(frozen=True)
class TrainingBytes:
    """Device bytes of a fine-tuning run per chip, activations apart (:func:`training_bytes`)."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def training_bytes(params: int, trainable: int | None = None, *, bytes_per_weight: int = 4,
                   optimizer_states: int = 2, shards: int = 1) -> TrainingBytes:
    """What the weights, their gradients and the optimizer state take on the device.

    ``params`` weights of ``bytes_per_weight`` (4: float32, 2: bfloat16); ``trainable`` of them
    get a gradient and ``optimizer_states`` states (AdamW: 2, ``exp_avg`` and ``exp_avg_sq``, in
    the weight's dtype as ``torch.optim.AdamW`` keeps them; SGD with momentum: 1; LoRA: the
    adapter's parameters only). ``shards``: FSDPv2 over that many chips divides all three.
    Activations are not included: they depend on the batch and the sequence length.
    """
    trainable = params if trainable is None else trainable
    split = lambda n: -(-n * bytes_per_weight // shards)  # noqa: E731  (rounded up)
    return TrainingBytes(split(params), split(trainable), split(trainable * optimizer_states))


def saved_activation_bytes(model: torch.nn.Module, *args, **kwargs) -> int:
    """Bytes autograd keeps for the backward of one ``model(*args, **kwargs)``: the activations
    (each storage once; parameters and views of them are weights, not counted). Any device; on
    the ``meta`` device a real model's shapes cost no memory and milliseconds."""
    weights, kept = {id(p) for p in model.parameters()}, {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base  # a view is stored once, with its base
        if id(t) not in weights and id(base) not in weights:
            kept[id(base)] = base
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(*args, **kwargs)
    return sum(t.nelement() * t.element_size() for t in kept.values())


def save_adapter(model: torch.nn.Module, folder: str | Path) -> dict[str, int]:
    """A ``peft`` model's trainable tensors alone (``adapter_model.safetensors`` and
    ``adapter_config.json``; file name -> bytes), from host copies: ``model.save_pretrained``
    on XLA tensors fails in safetensors 0.8.0 (``storage_ptr``: "invalid python storage").
    Each file is written atomically (``checkpoint.atomic_write``). Call it on one process."""
    host = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    folder, written = Path(folder), {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, state_dict=host)
        for file in sorted(Path(tmp).iterdir()):
            data = file.read_bytes()
            atomic_write(folder / file.name, lambda f, data=data: f.write(data))
            written[file.name] = len(data)
    return written


@torch.no_grad()
def generate_greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int,
                    lengths: torch.Tensor | list[int] | None = None) -> torch.Tensor:
    """Greedy continuations, ``new_tokens`` tokens per prompt, one graph for every step: the
    prompts ``input_ids`` [batch, width] right-padded, ``lengths`` each row's own length
    (default: ``width``). Each step runs a causal LM (``model(input_ids=...).logits``) on the
    whole window (prompts plus room for the new tokens), takes the argmax at each row's last
    token and writes it after that token; the positions are device tensors, so shapes and graph
    never change. Causal attention keeps the padding after a row's last token out of its logits.
    No KV cache: a step recomputes the window (short outputs of small models); ``generate`` adds
    a token per step, a new shape, so a new graph per token on XLA. Dropout: call
    ``model.eval()`` first. Returns the new tokens [batch, new_tokens] on the host."""
    batch, width = input_ids.shape
    lengths = torch.full((batch,), width) if lengths is None else torch.as_tensor(lengths)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if (batch == 0 or new_tokens < 1 or lengths.shape != (batch,) or lengths.is_floating_point()
            or not 1 <= int(lengths.min()) <= int(lengths.max()) <= width
            or (limit is not None and width + new_tokens > limit)):
        raise ValueError(f"generate_greedy: need new_tokens >= 1, one integer length in "
                         f"1..{width} per row of {batch}, and width + new_tokens <= the model's "
                         f"max_position_embeddings ({limit}); got new_tokens={new_tokens}, "
                         f"lengths={lengths.tolist()}")
    device = next(model.parameters()).device
    window = torch.nn.functional.pad(input_ids.cpu(), (0, new_tokens))  # room for the new tokens
    # uploaded, not made on the device: a lazy arange would make the first step's graph differ
    window, last, rows = (t.to(device) for t in (window, lengths - 1, torch.arange(batch)))
    for _ in range(new_tokens):
        token = model(input_ids=window).logits[rows, last].argmax(-1)
        last = last + 1
        window = window.index_put((rows, last), token)
        torch_xla.sync()  # one step's graph, the same at every step
    return window.cpu().gather(1, lengths[:, None] + torch.arange(new_tokens))  # each row's own
