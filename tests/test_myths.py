"""The facts notebook 08 states, pinned as fast tests.

Notebook 08 asserts the claims that belong to it (sections 1-10: backends, DDP, removed APIs,
bfloat16, the batch-size rule) and links the others to the notebook that teaches them (section
11's table "Myths corrected where they are taught": sharding in 01, loaders in 02, recompiles in
05, Lightning's sampler in 06). Both kinds are pinned here, so if an upgrade of torch /
torch_xla / Lightning changes one of them this file says which row or cell of
``notebooks/08_myths_and_facts.ipynb`` needs rewriting.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO
from torch.utils.data import DistributedSampler


def test_xmp_spawn_refuses_nprocs_8():
    import torch_xla.distributed.xla_multiprocessing as xmp

    with pytest.raises(ValueError, match=r"^Unsupported nprocs \(8\)"):
        xmp.spawn(print, nprocs=8, start_method="fork")


def test_removed_runtime_queries_are_gone():
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    assert not hasattr(xm, "xrt_world_size")  # removed in 2.7: the myth
    assert not hasattr(xm, "get_ordinal")  # removed in 2.7 too
    assert callable(xr.world_size) and callable(xr.global_ordinal)


def test_torch_xla_needs_neither_jax_nor_the_retired_tpu_node_client():
    reqs = md.requires("torch_xla") or []
    base = [r for r in reqs if "extra ==" not in r]
    assert not any(r.split()[0].startswith("jax") for r in base)
    retired = ("cloud-tpu-client", "cloud_tpu_client")  # myth: for TPU Nodes, now retired
    assert not any(name in r for name in retired for r in reqs)


def test_nccl_does_not_start_without_a_gpu():
    import torch.distributed as dist

    with pytest.raises((ValueError, RuntimeError)):  # ProcessGroupNCCL needs GPUs
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_lightning_removed_argument():
    import lightning as L

    with pytest.raises(TypeError, match="tpu_cores"):  # removed in Lightning 2.0: the myth
        L.Trainer(tpu_cores=8)  # the myth: removed argument, a TypeError now


def test_six_items_on_eight_replicas():
    padded = [list(DistributedSampler(range(6), num_replicas=8, rank=r, shuffle=False))
              for r in range(8)]
    assert sum(padded, []) == [0, 1, 2, 3, 4, 5, 0, 1]
    assert all(not list(DistributedSampler(range(6), num_replicas=8, rank=r, drop_last=True))
               for r in range(8))


def test_lightning_inserts_distributed_samplers_by_default():
    import inspect

    import lightning as L

    assert inspect.signature(L.Trainer).parameters["use_distributed_sampler"].default is True


def test_parallel_loader_keeps_batch_size_and_count():
    import torch
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    from torch.utils.data import DataLoader, TensorDataset

    device = torch_xla.device()
    data = TensorDataset(torch.arange(18.0).reshape(6, 3))
    sizes = [x.shape[0] for (x,) in pl.MpDeviceLoader(DataLoader(data, batch_size=1), device)]
    assert sizes == [1] * 6


def test_dataset_items_are_made_on_the_host_and_only_then_moved_to_the_device():
    """Section 11's row "the Dataset's transforms run on the TPU": MpDeviceLoader's loader thread
    iterates the DataLoader (``__getitem__`` runs there, on CPU tensors), and the batches reach
    the XLA device afterwards (torch_xla/distributed/parallel_loader.py)."""
    import threading

    import torch
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    from torch.utils.data import DataLoader, Dataset

    seen = []

    class Recording(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            item = torch.full((3,), float(i)) * 2  # the "transform"
            seen.append((threading.current_thread() is threading.main_thread(), item.device.type))
            return item

    device = torch_xla.device()
    batches = list(pl.MpDeviceLoader(DataLoader(Recording(), batch_size=4), device))
    assert [b.device.type for b in batches] == ["xla", "xla"]
    assert len(seen) == 8 and all(d == "cpu" for _, d in seen)
    assert not any(on_main for on_main, _ in seen)  # the loader thread, not the training loop


GLOO_RANK = r"""
import json, os, torch, torch.distributed as dist, torch_xla
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
on_cpu = torch.full((3,), rank + 1.0)
on_xla = torch.full((3,), rank + 1.0).to(torch_xla.device())
dist.all_reduce(on_cpu)
dist.all_reduce(on_xla)
print(json.dumps({"cpu": on_cpu.tolist(), "xla": on_xla.cpu().tolist()}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_gloo_leaves_xla_tensors_unreduced():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "TF_CPP_MIN_LOG_LEVEL": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(GLOO_RANK)], cwd=REPO,
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["cpu"] for r in results] == [[3.0] * 3, [3.0] * 3]
    assert [r["xla"] for r in results] == [[1.0] * 3, [2.0] * 3]  # silently not reduced


def test_xla_compiles_once_per_shape_and_each_item_is_a_transfer():
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def count(name):
        xm.wait_device_ops()
        data = met.metric_data(name)
        return data[0] if data else 0

    device = torch_xla.device()
    w = torch.randn(16, 4).to(device)
    batches = [torch.randn(rows, 16).to(device) for rows in (32, 32, 32, 31)]
    torch_xla.sync()
    met.clear_all()
    losses = []
    for b in batches:
        losses.append((b @ w).relu().sum())
        torch_xla.sync()
    assert count("CompileTime") == 2  # 32 rows once, then the new shape (31 rows) once more
    before = count("TransferFromDeviceTime")
    _ = [loss.item() for loss in losses]
    assert count("TransferFromDeviceTime") - before == len(losses)  # one per .item()


XLA_USE_BF16_PROBE = r"""
import json, torch, torch_xla
t = torch.tensor([1.0 + 2 ** -10]).to(torch_xla.device())  # exact in float32, not in bfloat16
hlo = torch_xla._XLAC._get_xla_tensors_text([t * 1])
print(json.dumps({"dtype": str(t.dtype), "value": t.cpu().item(),
                  "stored_bf16": "bf16[1]" in hlo and "f32[1]" not in hlo}))
"""


@pytest.mark.parametrize("flag", ["0", "1"])
def test_xla_use_bf16_is_deprecated_and_silently_stores_float32_as_bfloat16(flag):
    """Notebook 08's table row "`XLA_USE_BF16=1` is how to use bfloat16". On 2.8 and 2.9 the
    variable still works (torch_xla/csrc/dtype.cpp, v2.8.0 and v2.9.0): it prints a deprecation
    notice on stdout and stores every float32 tensor as bfloat16 while ``dtype`` still says
    float32: pure-bfloat16 weights in disguise. Autocast is the replacement (notebook 09)."""
    env = {**os.environ, "XLA_USE_BF16": flag, "PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", XLA_USE_BF16_PROBE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "torch.float32"  # what the tensor says, with or without the flag
    notice = "XLA_USE_BF16 will be deprecated after the 2.6 release"
    if flag == "1":
        assert notice in out.stdout
        assert result["stored_bf16"] and result["value"] == 1.0  # 1 + 2**-10 rounded away
    else:
        assert notice not in out.stdout
        assert not result["stored_bf16"] and result["value"] == 1.0 + 2 ** -10


def test_bfloat16_needs_no_loss_scaling_float16_does():
    """Notebook 08's myth "bfloat16 needs loss scaling": a 1e-30 gradient underflows to 0 in
    float16 but not in bfloat16 (float32's exponent range); autocast on XLA, no GradScaler."""
    import torch
    import torch_xla

    grad = torch.tensor(1e-30)
    assert grad.half().item() == 0.0 and grad.bfloat16().item() > 0
    assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny
    w = torch.ones(8, 8).to(torch_xla.device()).requires_grad_()
    x = torch.full((2, 8), 1e-30).to(torch_xla.device())
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = x @ w
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert w.grad.min().item() > 0
