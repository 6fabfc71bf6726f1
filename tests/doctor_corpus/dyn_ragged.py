# expect: ragged-batches@14
# expect --run: recompiles@16
# A ragged last batch: 3 full batches and one of 5 per epoch (drop_last is left off).
import torch
import torch_xla
import torch_xla.distributed.parallel_loader as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch_xla.device()
model = nn.Linear(8, 4).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(3 * 16 + 5, 8), torch.randint(0, 4, (3 * 16 + 5,)))
train_loader = DataLoader(data, batch_size=16, shuffle=True)
for epoch in range(3):
    for x, y in pl.MpDeviceLoader(train_loader, device):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
# ruff: noqa
