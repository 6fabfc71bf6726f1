# copies: tpu_lightning.py checkpoint.py
# A tiny LightningModule on XLA:CPU: fit with atomic checkpoints, load one back safely, predict.
import lightning as L, numpy as np, torch
from lightning.pytorch.accelerators import XLAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from tpu_lightning import AtomicXLACheckpointIO, trainer_kwargs

class OneXLACPUDevice(XLAAccelerator):  # no TPU here: Lightning's TPU code on XLA:CPU
    is_available = staticmethod(lambda: True)
    auto_device_count = staticmethod(lambda: 1)
    parse_devices = staticmethod(lambda devices: 1)
    get_parallel_devices = staticmethod(lambda devices: [torch.device("xla", 0)])

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.lin(batch[0]), batch[1])
    def predict_step(self, batch, batch_idx):
        return self.lin(batch[0])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
data = TensorDataset(torch.randn(10, 3), torch.randint(0, 2, (10,)))
quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
ckpt = ModelCheckpoint(dirpath="ckpt", save_last=True)
kw = trainer_kwargs(1, accelerator=OneXLACPUDevice())
L.Trainer(**kw, max_epochs=2, callbacks=[ckpt], **quiet).fit(Tiny(), DataLoader(data, batch_size=4))
state = AtomicXLACheckpointIO().load_checkpoint("ckpt/last.ckpt")  # tensors only, on the CPU
assert state["epoch"] == 1 and state["state_dict"]["lin.weight"].device.type == "cpu"
model = Tiny.load_from_checkpoint("ckpt/last.ckpt")
rows = L.Trainer(**kw, **quiet).predict(model, DataLoader(data, batch_size=4))  # one process
with torch.no_grad():
    expected = model.cpu().lin(data.tensors[0]).numpy()
assert np.allclose(torch.cat([r.cpu() for r in rows]).numpy(), expected, atol=1e-5)
print("ok")
