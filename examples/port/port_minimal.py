"""original.py ported to torch_xla with the fewest changed lines (README: Port your own script).

TPU VM: python port_minimal.py    On XLA:CPU: PJRT_DEVICE=CPU python port_minimal.py
"""
import argparse
import csv
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from PIL import Image
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset, DistributedSampler
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr

DATA = Path(__file__).resolve().parents[2] / "data" / "digits"


class ToTensor:
    def __call__(self, image):
        return torch.from_numpy(np.asarray(image, np.float32) / 255.0)[None]


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, x):
        return (x - self.mean) / self.std


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Digits(Dataset):
    def __init__(self, root, split, transform=None):
        with open(Path(root) / "labels.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["split"] == split]
        self.images = np.stack([np.asarray(Image.open(Path(root) / r["file"]).convert("L"))
                                for r in rows])
        self.targets = [int(r["label"]) for r in rows]
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image = Image.fromarray(self.images[index])
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(128, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(pl.MpDeviceLoader(train_loader, device)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        xm.optimizer_step(optimizer)
        if batch_idx % args.log_interval == 0:
            xm.add_step_closure(lambda i, n, loss: print(
                f"Train Epoch: {epoch} [{i * n}/{len(train_loader.dataset)}]"
                f"\tLoss: {loss.item():.6f}"), args=(batch_idx, len(data), loss))


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for data, target in pl.MpDeviceLoader(test_loader, device):
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum")
            correct += (output.argmax(dim=1) == target).sum()
    test_loss, correct = test_loss.item() / len(test_loader.dataset), correct.item()
    print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {correct}/"
          f"{len(test_loader.dataset)} ({100.0 * correct / len(test_loader.dataset):.2f}%)")
    return correct / len(test_loader.dataset)


def _mp_fn(index):
    parser = argparse.ArgumentParser(description="Digits example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch_xla.device()

    transform = Compose([ToTensor(), Normalize(0.33, 0.38)])
    train_set = Digits(DATA, "train", transform)
    sampler = DistributedSampler(train_set, xr.world_size(), xr.global_ordinal(), seed=args.seed)
    # --batch-size stays the global batch, each replica loads its share. The toolkit port
    # splits with tpu_helpers.data.split_global_batch, which also refuses one that does not divide.
    train_loader = DataLoader(train_set, batch_size=args.batch_size // xr.world_size(),
                              sampler=sampler, drop_last=True)
    test_loader = DataLoader(Digits(DATA, "test", transform), batch_size=args.test_batch_size)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()
    if args.save_model:
        xm.save(model.state_dict(), "digits_cnn.pt")


if __name__ == "__main__":
    torch_xla.launch(_mp_fn)
