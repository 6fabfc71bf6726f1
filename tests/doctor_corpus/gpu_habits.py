# expect: cuda-only@18 torch-checkpoint-on-xla@19 cuda-only@27 cuda-only@31
# A script half-moved from a GPU: the device is XLA, but a block is checkpointed with torch's
# checkpoint (no optimization barrier: XLA merges the recomputation away), the model still goes
# .cuda(), and the step runs under torch.cuda.amp. Written for the doctor's corpus.
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
import torch_xla


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = nn.Linear(16, 16), nn.Linear(16, 2)

    def forward(self, x):
        x = x.cuda()
        x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.head(F.relu(x))


def main():
    device = torch_xla.device()
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.cuda.amp.GradScaler()
    for _ in range(4):
        x = torch.randn(8, 16, device=device)
        y = torch.randint(0, 2, (8,), device=device)
        with torch.cuda.amp.autocast():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        torch_xla.sync()


if __name__ == "__main__":
    main()
