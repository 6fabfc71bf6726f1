# copies: device_loader.py
# Iterate a StrictDeviceLoader on XLA:CPU; a host loader error reaches the loop.
import torch, torch_xla
from torch.utils.data import DataLoader, TensorDataset
from device_loader import StrictDeviceLoader
device = torch_xla.device()
loader = DataLoader(TensorDataset(torch.arange(32.0).reshape(16, 2)), batch_size=4)
batches = [x for (x,) in StrictDeviceLoader(loader, device)]
assert [x.shape[0] for x in batches] == [4, 4, 4, 4] and batches[0].device.type == "xla"
assert torch.equal(torch.cat([x.cpu() for x in batches]), loader.dataset.tensors[0])
class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        if i == 9:
            raise ValueError("sample 9 is corrupt")
        return torch.zeros(2)
try:
    for _ in StrictDeviceLoader(DataLoader(Broken(), batch_size=4), device):
        pass
    raise AssertionError("expected the worker's error")
except ValueError as exc:
    assert "sample 9" in str(exc), exc
print("ok")
