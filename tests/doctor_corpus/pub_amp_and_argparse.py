# expect: host-read-in-loop@36 cuda-only@45 cuda-only@47 launch-nprocs@59
# Written here, not copied. CUDA AMP switched by a flag that is off on XLA (notes, not alarms),
# CUDA AMP used bare around the XLA forward and a checkpoint mapped to CUDA (alarms), a GradScaler
# step written `scaler.scale(loss).backward(); scaler.step(optimizer)` whose loss is read every
# iteration, argparse defaults read: --num_cores 8 (refused), --amp store_true (off), --local_rank
# from LOCAL_RANK but never given to a sampler (clean). Models pytorch/ignite
# examples/cifar10/main.py @98fc8242da7b4792d7c5f520c1008e44fe3e2c6e (l.302, 312, 358),
# jotron/DeepLearningExamplesTPU PyTorch/Detection/SSD/main.py
# @248e1c826f86ae719cbf8d80c785437dda3f368c (l.115, 201, 223, 333), huggingface/transformers
# examples/run_tpu_glue.py @700ccf6e35616fcbee59de81edd60cec9e14fb6b (l.607, --num_cores default 8)
# and holynakamoto/iacgpt scripts/base_train_tpu.py @ee3b17f6b3632caf6e7c90ab10a9c2625b7dd279
# (l.107).
# ruff: noqa
import argparse
import os

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
from torch.amp import GradScaler, autocast


def create_trainer(model, optimizer, criterion, with_amp=False):
    scaler = GradScaler(enabled=with_amp)

    def train_step(engine, batch):
        x, y = batch
        with autocast("cuda", enabled=with_amp):
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return {"batch loss": loss.item()}

    return train_step


def train(index, args):
    args.local_rank = xr.global_ordinal()
    device = torch_xla.device()
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    state = torch.load(args.checkpoint, map_location=lambda storage, loc: storage.cuda(0))
    for images, targets in loader:
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            loss = model(images.to(device), targets.to(device))
        loss.backward()
        xm.optimizer_step(optimizer)


parser = argparse.ArgumentParser()
parser.add_argument("--num_cores", type=int, default=8)
parser.add_argument("--amp", action="store_true")
parser.add_argument("--local_rank", type=int, default=os.getenv("LOCAL_RANK", 0))
args = parser.parse_args()
args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
xmp.spawn(train, args=(args,), nprocs=args.num_cores)
