# copies: launch.py
# Your own loop under launch (no fit): it runs on every replica; a failure names the rank and
# keeps the traceback; what cannot be pickled is refused before any process starts.
import os, tempfile
import torch, torch_xla
from launch import ReplicaFailed, launch
out = tempfile.mkdtemp()

def my_loop(rank, folder):  # the user's per-replica function
    value = (torch.ones(4, device=torch_xla.device()) * (rank + 1)).sum().item()
    open(os.path.join(folder, f"rank-{rank}"), "w").write(str(value))

def broken(rank):
    raise ValueError(f"bad record in shard {rank}")

launch(my_loop, args=(out,))
assert os.listdir(out) == ["rank-0"] and open(os.path.join(out, "rank-0")).read() == "4.0"
try:
    launch(broken)
    raise AssertionError("no ReplicaFailed")
except ReplicaFailed as exc:
    assert exc.rank == 0 and exc.summary == "ValueError: bad record in shard 0", exc.summary
    assert "in broken" in exc.details
try:
    launch(lambda rank: None)
    raise AssertionError("a lambda was sent")
except TypeError as exc:
    assert str(exc).startswith("launch cannot send fn "), exc
assert not torch_xla._XLAC._xla_runtime_is_initialized()  # the parent never touched a device
print("ok")
