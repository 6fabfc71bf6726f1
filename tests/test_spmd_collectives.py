"""What notebook 07 says XLA does under FSDPv2, read from the compiled program: one training
step of its MLP (``SpmdFullyShardedDataParallel``, 4 virtual XLA:CPU devices, the batch sharded
over ``'fsdp'``), with XLA's optimized HLO dumped (``--xla_dump_to``) and its collectives counted.

FSDPv2 only annotates; the partitioner picks the collectives. For this small MLP it keeps both
weight matrices split (no all-gather of a [256, 64] or [10, 256] weight), gathers the batch
instead and all-reduces partial results; it forms no reduce-scatter on XLA:CPU. Each gradient
keeps its parameter's sharding. What a TPU's compiler picks for a big model is not run here."""

from __future__ import annotations

import json
import re

from conftest import run_python

STEP = """
import json, sys
import numpy as np, torch, torch.nn.functional as F
import torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2)
xr.use_spmd()
dev = torch_xla.device()
mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))
torch.manual_seed(0)
model = FSDPv2(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 10)).to(dev), mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 64).to(dev), torch.randint(0, 10, (64,)).to(dev)
xs.mark_sharding(x, mesh, ("fsdp", None))
xs.mark_sharding(y, mesh, ("fsdp",))
F.cross_entropy(model(x), y).backward()
opt.step()
torch_xla.sync()
spec = torch_xla._XLAC._get_xla_sharding_spec
print("RESULT " + json.dumps([[spec(p), spec(p.grad)] for p in model.parameters()]))
"""


def test_fsdpv2_step_keeps_the_weights_split_gathers_the_batch_and_shards_gradients(tmp_path):
    dump = tmp_path / "hlo"
    proc = run_python(STEP, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4",
                                 "XLA_FLAGS": f"--xla_dump_to={dump}"})
    specs = json.loads(next(x for x in proc.stdout.splitlines()
                            if x.startswith("RESULT ")).removeprefix("RESULT "))
    print(specs)
    assert all(p == g and p.startswith("{devices=") for p, g in specs)  # grads sharded like params
    (step,) = [f for f in dump.glob("*after_optimizations.txt")
               if "all-gather(" in f.read_text() or "all-reduce(" in f.read_text()]
    hlo = step.read_text()
    shapes = {op: re.findall(rf"= f32\[([\d,]*)\]\S* {op}\(", hlo)
              for op in ("all-gather", "reduce-scatter", "all-reduce")}
    print(step.name, shapes)
    assert "256,64" not in shapes["all-gather"] and "10,256" not in shapes["all-gather"]
    assert "64,64" in shapes["all-gather"]      # the batch [64, 64], gathered
    assert shapes["reduce-scatter"] == []       # none on XLA:CPU
    assert "64,10" in shapes["all-reduce"]      # partial logits summed over the hidden split
