"""original.py on the toolkit: its Dataset, model, loss, optimizer and schedule given to
tpu_helpers.train (copied into your project as a tpu_helpers/ folder: README, Port your own
script). Checkpoints and resumes bit for bit, names the failing rank, compiles once.

TPU VM: python port_toolkit.py --out-dir run    On XLA:CPU: PJRT_DEVICE=CPU python ...
"""
import os

# XLA compiles the scalars 0 and +-1 into the graph as constants, other Python floats are
# device data: without this, the first StepLR step away from lr 1.0 compiles the step again.
os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")

import csv
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from PIL import Image
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset

from tpu_helpers.train import Config, parser, train

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


def make_optimizer(params, config):
    return optim.Adadelta(params, lr=config.lr)


def make_scheduler(optimizer, config):
    return StepLR(optimizer, step_size=1, gamma=GAMMA)


GAMMA = 0.7


def main():
    args = parser()
    args.set_defaults(global_batch=64, eval_global_batch=1000, epochs=6, lr=1.0, seed=1,
                      log_every=10)
    config = Config(**vars(args.parse_args()))
    transform = Compose([ToTensor(), Normalize(0.33, 0.38)])
    history = train(config, Digits(DATA, "train", transform), Net,
                    eval_data=Digits(DATA, "test", transform), loss_fn=F.nll_loss,
                    optimizer_fn=make_optimizer, scheduler_fn=make_scheduler)
    for row in history["epochs"]:
        print(f"epoch {row['epoch']}: lr {row['lr']:.4f} loss {row['train_loss']:.4f} "
              f"Test set: Average loss: {row['eval_loss']:.4f}, Accuracy: "
              f"{round(row['eval_acc'] * row['eval_count'])}/{row['eval_count']} "
              f"({100.0 * row['eval_acc']:.2f}%)")


if __name__ == "__main__":
    main()
