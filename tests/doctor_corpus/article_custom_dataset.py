# expect: ragged-batches@29 deprecated-api@33 deprecated-api@49 no-distributed-sampler@54 ragged-batches@54 removed-api@54 launch-nprocs@71
# "How can I train a PyTorch model on a TPU using a custom dataset?" (a Q&A article, 2025):
# its first two code blocks, one script, as the article prints them (notebooks 01-03, 05 and 08
# correct it); line 67's loss.item() runs every 10 batches: an info note, not an alarm.
# ruff: noqa
import torch
from torch.utils.data import Dataset, DataLoader
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

class CustomDataset(Dataset):
    def __init__(self, data, targets):
        self.data = data
        self.targets = targets

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return torch.tensor(self.data[idx], dtype=torch.float32), torch.tensor(self.targets[idx], dtype=torch.long)

# Dummy Data
dummy_data = [[1,2,3], [4,5,6], [7,8,9], [10,11,12], [13,14,15], [16,17,18]]
dummy_targets = [0, 1, 0, 1, 0, 1]

dataset = CustomDataset(dummy_data, dummy_targets)

# Create the DataLoader - do not worry about batch size, it is handled later
data_loader = DataLoader(dataset, batch_size=1, shuffle=True)


# Create a ParallelLoader
para_loader = pl.ParallelLoader(data_loader, [xm.xla_device()])

import torch.nn as nn
import torch.optim as optim
import torch_xla.distributed.xla_multiprocessing as xmp

# A simple linear model for demonstration
class SimpleModel(nn.Module):
    def __init__(self):
        super(SimpleModel, self).__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x)

def train_loop(index, flags):
    device = xm.xla_device()
    model = SimpleModel().to(device)
    optimizer = optim.Adam(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()

    data_loader = DataLoader(dataset, batch_size=flags['batch_size'] // xm.xrt_world_size(), shuffle=True)
    para_loader = pl.ParallelLoader(data_loader, [device])

    num_epochs = 5
    for epoch in range(num_epochs):
        for batch_idx, (data, target) in enumerate(para_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)

            if batch_idx % 10 == 0:
              xm.master_print(f"Epoch {epoch}, Batch {batch_idx}: Loss {loss.item()}")

FLAGS = {}
FLAGS['batch_size'] = 8
xmp.spawn(train_loop, args=(FLAGS,), nprocs=8, start_method='fork') # Spawn 8 TPU cores
