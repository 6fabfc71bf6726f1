# expect: removed-api@12
# expect --run: crash@12
# An old article's line: xm.xrt_world_size() was removed in torch_xla 2.7.
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn

device = torch_xla.device()
model = nn.Linear(8, 4).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
per_core = 64 // xm.xrt_world_size()
# ruff: noqa
