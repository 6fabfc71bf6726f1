# expect:
# expect --run: recompiles@20
# Each batch padded to its own longest sequence: a new input shape (a new graph) per length.
import torch
import torch_xla
from torch import nn
from torch.nn.utils.rnn import pad_sequence

device = torch_xla.device()
torch.manual_seed(0)
embed, head = nn.Embedding(50, 16).to(device), nn.Linear(16, 2).to(device)
opt = torch.optim.SGD([*embed.parameters(), *head.parameters()], lr=0.1)
for step in range(12):
    lengths = torch.randint(2, 4 + step, (8,))  # longer texts later: a new longest each batch
    batch = pad_sequence([torch.randint(1, 50, (int(n),)) for n in lengths], batch_first=True)
    tokens, labels = batch.to(device), (lengths % 2).to(device)
    nn.functional.cross_entropy(head(embed(tokens).mean(dim=1)), labels).backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
# ruff: noqa
