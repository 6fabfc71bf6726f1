# expect: rank-from-env@23 rank-from-env@26 predicate-not-called@34
# Written here, not copied, for issue 37's list (none of the 26 scored public files shows these):
# a sampler ranked from LOCAL_RANK/RANK/WORLD_SIZE, which xmp.spawn and torch_xla.launch do not
# set (torch_xla/_internal/pjrt.py at v2.8.0/v2.9.0 sets PJRT_LOCAL_PROCESS_RANK/COUNT; torchrun
# sets them, and the sampler ranked by xr.global_ordinal() is fine), also through an argparse
# default; `xm.is_master_ordinal == True`, a function compared (always False), next to the
# right call; XLA_TENSOR_ALLOCATOR_MAXSIZE, an XRT setting torch_xla 2.8/2.9 ignore (a note).
# ruff: noqa
import argparse
import os

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch.utils.data import DataLoader, DistributedSampler

os.environ["XLA_TENSOR_ALLOCATOR_MAXSIZE"] = "100000000"
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", 0)))


def _mp_fn(index, args, dataset, model):
    sampler = DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]),
                                 rank=int(os.environ.get("RANK", 0)))
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, drop_last=True)
    flagged = DistributedSampler(dataset, num_replicas=xr.world_size(), rank=args.local_rank)
    good = DistributedSampler(dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal())
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        xm.optimizer_step(model.optimizer)
    if xm.is_master_ordinal():
        print("done")
    if xm.is_master_ordinal == True:
        xm.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    torch_xla.launch(_mp_fn, args=(parser.parse_args(), None, None))
