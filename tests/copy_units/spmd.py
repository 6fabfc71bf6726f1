# copies: spmd.py
# SPMD over 4 virtual XLA:CPU devices: a mesh, a sharded tensor, a sharded checkpoint saved
# and loaded back. CPU_NUM_DEVICES must be set before torch_xla starts its runtime.
import os
os.environ["CPU_NUM_DEVICES"] = "4"
import tempfile
import torch, torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from spmd import device_mesh, load_sharded_checkpoint, save_sharded_checkpoint, sharding_summary
xr.use_spmd()
mesh = device_mesh(("data", "model"), (2, 2))
w = torch.randn(8, 6).to(torch_xla.device())
xs.mark_sharding(w, mesh, ("data", "model"))
row, = sharding_summary({"w": w})
assert row["copies"] == 1 and row["fraction"] == 0.25, row
folder = save_sharded_checkpoint({"w": w}, os.path.join(tempfile.mkdtemp(), "ck"))
back = {"w": torch.zeros(8, 6).to(torch_xla.device())}
xs.mark_sharding(back["w"], mesh, ("data", "model"))
load_sharded_checkpoint(back, folder)
assert torch.equal(back["w"].cpu(), w.cpu())
print("ok")
