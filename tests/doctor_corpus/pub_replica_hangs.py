# expect: deprecated-api@26 xla-device-index@26 uneven-shard@31 deprecated-api@36 deprecated-api@44 sync-before-step@44 collective-on-some-ranks@48 collective-on-some-ranks@51 collective-on-some-ranks@58
# Written here for issue 38 (what makes one replica wait forever) and issue 37's list. Traps, clean:
# the paired rendezvous of huggingface/transformers examples/run_tpu_glue.py @ 700ccf6e (2020;
# `if not xm.is_master_ordinal(): xm.rendezvous("download_only_once")` ... the master's twin),
# its rendezvous after a master-only save, xm.save under the master's test (no collective in
# torch_xla 2.8/2.9), a sync after the optimizer step and between accumulation backward passes
# (UCSC-VLAA/CLIPA clipa_torch/training/train.py @ ebd75e2, 2023), a shard by the sampler, a slice
# that is not by rank. Faults: a device by index (the `xm.xla_device(n=8)` of the lightning-tpu
# Kaggle kernel in PLSE-Lab/Python-MLAPI-expl @ c8783d1; torch_xla.device(n) raises IndexError in
# every process but one), a shard by rank of unequal length, a sync between backward and the
# optimizer step, a rendezvous and a mesh_reduce only the master reaches, a rank-only break.
# ruff: noqa
import os

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr


def train(index, rows, model, loss_fn, max_steps):
    if not xm.is_master_ordinal():
        xm.rendezvous("download_only_once")
    if xm.is_master_ordinal():
        xm.rendezvous("download_only_once")
    device = xm.xla_device(index)
    good = torch_xla.device()
    rank, world = xr.global_ordinal(), xr.world_size()
    sampler = torch.utils.data.distributed.DistributedSampler(rows, num_replicas=world, rank=rank)
    firsts = rows[:world]  # not a shard by rank
    train_rows = rows[rank::world]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(train_rows):
        for _ in range(2):  # accumulation: a sync between backward passes is one graph each
            loss_fn(model(x), y).backward()
            xm.mark_step()
        xm.optimizer_step(optimizer)
        torch_xla.sync()
        if xm.is_master_ordinal():
            xm.save(model.state_dict(), "model.pt")
        xm.rendezvous("saved")
    for step, (x, y) in enumerate(train_rows):
        loss_fn(model(x), y).backward()
        xm.mark_step()
        optimizer.step()
        optimizer.zero_grad()
        if xm.is_master_ordinal():
            xm.rendezvous("epoch_end")
        total = loss_fn(model(x), y).detach()
        if xr.global_ordinal() == 0:
            total = xm.mesh_reduce("loss", total, sum)
        print(firsts, sampler, good, device)
    for step, (x, y) in enumerate(train_rows):
        loss_fn(model(x), y).backward()
        xm.optimizer_step(optimizer)
        torch_xla.sync()
        if rank == 0 and step >= max_steps:
            break
