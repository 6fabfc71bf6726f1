# expect:
# expect --run: cpu-fallback@17 host-transfers@17
# An op with no XLA lowering in the step: aten::bincount runs on the CPU.
import torch
import torch_xla
from torch import nn

device = torch_xla.device()
model = nn.Linear(8, 4).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
counts = torch.zeros(4, dtype=torch.long, device=device)
for step in range(12):
    x, y = torch.randn(16, 8).to(device), torch.randint(0, 4, (16,)).to(device)
    logits = model(x)
    nn.functional.cross_entropy(logits, y).backward()
    opt.step()
    counts += torch.bincount(logits.argmax(dim=1), minlength=4)
    opt.zero_grad()
    torch_xla.sync()
# ruff: noqa
