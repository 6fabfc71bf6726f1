# expect: stale-install-pin@21 stale-install-pin@22 deprecated-api@26 removed-api@37 removed-api@43 ragged-batches@44 deprecated-api@45 host-read-in-loop@56 launch-nprocs@60
# Written here, not copied: the shape of the 2020 Kaggle TPU kernels, exported by nbconvert. An
# env-setup.py install (its two lines), XLA_USE_BF16 set (and only read later: no
# second finding), removed xrt_world_size/get_ordinal, a training DataLoader named `dataloader` that
# reaches the loop through ParallelLoader(...).per_device_loader() and tqdm (found by what it
# feeds), the loss printed every 10 batches (a note) and every batch (an alarm), nprocs=8. Models
# PLSE-Lab/Python-MLAPI-expl @c8783d17fe82a606cab35414cc088347c825c178
# python_sources/bert-multi-lingual-tpu-training-8-cores.py (l.7-8, 172, 226-227, 299),
# python_sources/pytorch-tpu-efficientnet-b5-tutorial-reference.py (l.16, 228, 275, 347),
# python_sources/torch-xla-melanoma-crazy-fast.py (l.27, 40),
# python_sources/tpu-training-super-fast-xlmroberta.py (l.31, 45), huggingface/transformers
# examples/run_tpu_glue.py @700ccf6e35616fcbee59de81edd60cec9e14fb6b (l.107, 193) and
# jotron/DeepLearningExamplesTPU PyTorch/Detection/SSD/main.py
# @248e1c826f86ae719cbf8d80c785437dda3f368c (l.288: XLA_USE_BF16 only read).
# ruff: noqa
#!/usr/bin/env python
# coding: utf-8

# In[1]:

get_ipython().system('curl https://raw.githubusercontent.com/pytorch/xla/master/contrib/scripts/env-setup.py -o pytorch-xla-env-setup.py')
get_ipython().system('python pytorch-xla-env-setup.py --apt-packages libomp5 libopenblas-dev')
get_ipython().system('pip install transformers > /dev/null')
import os

os.environ["XLA_USE_BF16"] = "1"
import torch
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp
from torch.utils.data import DataLoader
from tqdm import tqdm


def get_sampler(dataset):
    return torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=xm.xrt_world_size(), rank=xm.get_ordinal(), shuffle=True)


def run(train_dataset, model, optimizer, loss_fn):
    precision = "bf16" if os.getenv("XLA_USE_BF16") else "fp32"
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=xm.xrt_world_size(), rank=xm.get_ordinal(), shuffle=True)
    dataloader = DataLoader(train_dataset, sampler=sampler, batch_size=32)
    device = xm.xla_device()
    model = model.to(device)
    device_loader = pl.ParallelLoader(dataloader, [device]).per_device_loader(device)
    for bi, batch in enumerate(tqdm(device_loader)):
        optimizer.zero_grad()
        outputs = model(batch["ids"])
        loss = loss_fn(outputs, batch["targets"])
        loss.backward()
        xm.optimizer_step(optimizer)
        if bi % 10 == 0:
            xm.master_print(f"bi={bi}, loss={loss}, {precision}")
        xm.master_print(f"loss={loss.item()}")


if __name__ == "__main__":
    xmp.spawn(run, args=(), nprocs=8, start_method="fork")
