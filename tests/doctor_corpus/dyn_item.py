# expect: host-read-in-loop@17
# expect --run: host-transfers@17
# The loss read back every step (`.item()` before the step's sync).
import torch
import torch_xla
from torch import nn

device = torch_xla.device()
model = nn.Linear(8, 4).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 8).to(device), torch.randint(0, 4, (16,)).to(device)
for step in range(12):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
    torch_xla.sync()
# ruff: noqa
