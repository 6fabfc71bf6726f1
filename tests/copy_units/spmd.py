# copies: spmd.py
# SPMD over 4 virtual XLA:CPU devices: a mesh (its shape checked), a tensor sharded on it, its
# annotation and the bytes each device holds. CPU_NUM_DEVICES must be set before torch_xla
# starts its runtime. (Sharded checkpoints are their own unit: sharded_checkpoint.py.)
import os
os.environ["CPU_NUM_DEVICES"] = "4"
import torch, torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from spmd import (device_mesh, jax_lowers_for_gspmd, mesh_shapes, resolve_mesh_shape,
                  sharding_spec, sharding_summary)
xr.use_spmd()
assert mesh_shapes(4, 2) == [(1, 4), (2, 2), (4, 1)]
assert resolve_mesh_shape(4, ("fsdp", "model"), (-1, 2)) == (2, 2)
mesh = device_mesh(("data", "model"), (2, 2))
assert tuple(mesh.mesh_shape) == (2, 2), mesh.mesh_shape
try:
    device_mesh(("data", "model"), (4, 4))
    raise AssertionError("a (4, 4) mesh was accepted on 4 devices")
except ValueError as exc:
    assert "(1, 4), (2, 2), (4, 1)" in str(exc), exc  # the shapes that fit
w = torch.randn(8, 6).to(torch_xla.device())
assert sharding_spec(w) == "" and sharding_spec(torch.zeros(2)) == ""  # not annotated
xs.mark_sharding(w, mesh, ("data", "model"))
assert sharding_spec(w) == "{devices=[2,2]0,1,2,3}", sharding_spec(w)
assert torch.equal((w * 2).cpu(), w.cpu() * 2)
(row,) = sharding_summary({"w": w})  # read from the annotation: nothing copied
assert (row["copies"], row["bytes"], row["bytes/device"]) == (1, 8 * 6 * 4, 4 * 3 * 4), row
print(jax_lowers_for_gspmd())
print("ok")
