# expect:
# expect --run:
# The fixed loop: one shape (drop_last), the loss read in a step closure every 4 steps, and
# an evaluation after the training loop's last torch_xla.sync().
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def _mp_fn(index):
    device = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(6 * 16 + 5, 8), torch.randint(0, 4, (6 * 16 + 5,)))
    sampler = DistributedSampler(data, num_replicas=xr.world_size(), rank=xr.global_ordinal())
    train_loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(pl.MpDeviceLoader(train_loader, device)):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            xm.optimizer_step(opt)
            opt.zero_grad()
            if step % 4 == 0:
                xm.add_step_closure(lambda v: print(f"loss {v.item():.3f}"), args=(loss,))
    torch_xla.sync()
    with torch.no_grad():
        correct = (model(data.tensors[0].to(device)).argmax(1) == data.tensors[1].to(device))
    print("accuracy", correct.float().mean().item())


if __name__ == "__main__":
    torch_xla.launch(_mp_fn)
# ruff: noqa
