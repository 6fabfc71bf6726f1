# expect:
# Written here, not copied: the fix the pretrained-per-replica finding names, which must stay
# clean: SPMD (one process per host, xr.use_spmd() first), each tensor sharded over the mesh as it
# arrives (FSDPv2's layout), the host index read for logging only; and the model built on the
# device, then streamed one tensor at a time (tpu_helpers.pretrained.stream_to_device).
# ruff: noqa
import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from transformers import AutoConfig, AutoModelForCausalLM

from tpu_helpers.pretrained import stream_to_device

xr.use_spmd()
device = torch_xla.device()
mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (xr.global_runtime_device_count(), 1),
               ("fsdp", "model"))
print(f"host {xr.process_index()}: ordinal {xr.global_ordinal()}")
model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-2-7b-hf").to(device)
for name, param in model.named_parameters():
    if param.dim() == 2:
        xs.mark_sharding(param, mesh, ("fsdp", None))
with torch.device(device):
    student = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("student"))
stream_to_device(student, "student")
student.load_state_dict(torch.load("adapter.pt", mmap=True), strict=False)
