# copies: lightning_writer.py ordering.py checkpoint.py
# trainer.predict with the exactly-once writer on XLA:CPU (one process), then what two processes
# do: each rank writes its rows (the sampler repeated a sample to even them out), rank 0 merges.
import lightning as L, numpy as np, torch
from lightning.pytorch.accelerators import XLAAccelerator
from torch.utils.data import DataLoader, TensorDataset
from lightning_writer import ExactlyOncePredictionWriter, read_predictions

class OneXLACPUDevice(XLAAccelerator):  # no TPU here: Lightning's TPU code on XLA:CPU
    is_available = staticmethod(lambda: True)
    auto_device_count = staticmethod(lambda: 1)
    parse_devices = staticmethod(lambda devices: 1)
    get_parallel_devices = staticmethod(lambda devices: [torch.device("xla", 0)])

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
    def predict_step(self, batch, batch_idx):
        return self.lin(batch[0])

torch.manual_seed(0)
data = TensorDataset(torch.randn(7, 3))
model, writer = Tiny(), ExactlyOncePredictionWriter("preds")
trainer = L.Trainer(accelerator=OneXLACPUDevice(), devices=1, callbacks=[writer], logger=False,
                    enable_progress_bar=False, enable_model_summary=False)
merged = writer.predict(trainer, model, DataLoader(data, batch_size=3))
with torch.no_grad():
    expected = model.cpu().lin(data.tensors[0]).numpy()
assert merged.index.tolist() == list(range(7)) and np.allclose(merged.values, expected, atol=1e-5)
assert np.array_equal(read_predictions("preds").values, merged.values)  # in any process
rows = lambda idx: torch.tensor(idx, dtype=torch.float32)[:, None] * 10  # row i holds 10 i
for rank, batches in enumerate([[[0, 2], [4]], [[1, 3], [0]]]):  # 5 samples, 0 given twice
    ranks = ExactlyOncePredictionWriter("two")
    for batch_idx, idx in enumerate(batches):
        ranks.write_on_batch_end(None, None, rows(idx), idx, None, batch_idx, 0)
    ranks.save_rank(rank, world_size=2, n=5)
two = ExactlyOncePredictionWriter("two").merge(world_size=2, n=5)
assert two.values[:, 0].tolist() == [0, 10, 20, 30, 40] and two.duplicates == 1, two
print("ok")
