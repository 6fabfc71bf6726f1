# copies: sharded_checkpoint.py checkpoint.py
# An FSDP-style sharded model over 4 virtual XLA:CPU devices saved without a gather, loaded into a
# fresh copy with its shardings; a wrong shape is named first; a crafted .metadata runs no code.
import os
os.environ["CPU_NUM_DEVICES"] = "4"
import pickle
import numpy as np, torch, torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from sharded_checkpoint import (ShardedCheckpointError, load_sharded_checkpoint,
                                save_sharded_checkpoint)
xr.use_spmd()
mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))

def sharded_model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 8).to(torch_xla.device())
    xs.mark_sharding(model.weight, mesh, ("fsdp", None))  # rows split over the 4 devices
    return model

model, fresh = sharded_model(0), sharded_model(1)
folder = save_sharded_checkpoint(model.state_dict(), "ckpt/step-1")
save_sharded_checkpoint(model.state_dict(), folder)  # again: the old one swapped out atomically
assert sorted(os.listdir("ckpt")) == ["step-1"] and (folder / ".metadata").is_file()
load_sharded_checkpoint(fresh.state_dict(), folder)
assert torch.equal(fresh.weight.cpu(), model.weight.cpu()), "not loaded back bit for bit"
spec = xs.XLAShardedTensor(fresh.weight).sharding_spec
assert spec == "{devices=[4,1]0,1,2,3}", spec  # the sharding is kept, no load_state_dict step
try:
    load_sharded_checkpoint({"bias": torch.zeros(3)}, folder)
    raise AssertionError("a wrong shape was loaded")
except ValueError as exc:
    assert "'bias' has shape (8,) in the checkpoint but (3,) in the model" in str(exc), exc

class Payload:  # what a crafted checkpoint would run on an unpickle
    def __reduce__(self):
        return (os.makedirs, ("pwned",))

(folder / ".metadata").write_bytes(pickle.dumps(Payload()))
try:
    load_sharded_checkpoint(fresh.state_dict(), folder)
    raise AssertionError("a crafted .metadata was loaded")
except ShardedCheckpointError as exc:
    assert "refused: not a plain checkpoint metadata file" in str(exc), exc
assert not os.path.exists("pwned")
print("ok")
