# expect: stale-install-pin@16 ragged-batches@29 host-read-in-loop@43 lightning-removed-arg@49 lightning-removed-arg@50
# Written here, not copied: a jupytext (percent-format) Lightning notebook of the torch_xla 1.8
# era. Its install line is a commented magic (# ! pip install cloud-tpu-client ... torch_xla-1.8
# ... cp37 wheel); the datamodule's train_dataloader() returns a loader without drop_last (a
# training loader by its hook), val/test loaders are evaluation (clean); training_step logs
# loss.item() every step; Trainer(tpu_cores=8) and its pre-1.0 spelling num_tpu_cores=8. Models
# Lightning-AI/tutorials lightning_examples/mnist-tpu-training/mnist-tpu.py
# @8799474a58cb55f48e019755ae5593497f6deeb6 (l.5, 55) and oke-aditya/Machine_Learning
# Learning_Pytorch_Lightning/train_tpu_mnist.py @72eee0846dc0d5f177ef1d624dceaf391b85d0b1 (l.5).
# ruff: noqa

# %% [markdown]
# ### Install Colab TPU compatible PyTorch/TPU wheels and dependencies

# %%
# ! pip install cloud-tpu-client==0.10 https://storage.googleapis.com/tpu-pytorch/wheels/torch_xla-1.8-cp37-cp37m-linux_x86_64.whl

# %%
import pytorch_lightning as pl
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

BATCH_SIZE = 1024


class MNISTDataModule(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=BATCH_SIZE)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=BATCH_SIZE)


class LitModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Linear(28 * 28, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x.view(x.size(0), -1)), y)
        self.log("train_loss", loss.item())
        return loss


# %%
dm, model = MNISTDataModule(), LitModel()
trainer = pl.Trainer(num_tpu_cores=8, max_epochs=10)
trainer = pl.Trainer(tpu_cores=8, max_epochs=3)
trainer.fit(model, dm)
