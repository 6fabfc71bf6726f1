# copies: env.py
# Where am I, and is it set up right: detect this machine, emulate a TPU on its CPU, check versions.
import os
from env import check_versions, configure_emulation, detect_runtime, runtime_initialized
rt = detect_runtime()
print(rt.summary())
assert rt.platform == "local" and not rt.has_tpu and rt.layout.world_size == 1
environ = {}
configure_emulation(4, environ=environ, runtime=rt)
assert environ["PJRT_DEVICE"] == "CPU" and environ["CPU_NUM_DEVICES"] == "4"
configure_emulation(1)  # this process: PJRT_DEVICE=CPU, one device
versions = check_versions(tpu=False)  # raises with the exact pip command on a mismatch
print(versions)
import torch, torch_xla
assert not runtime_initialized()  # importing torch_xla does not start the runtime
assert torch.ones(2, device=torch_xla.device()).sum().item() == 2.0 and runtime_initialized()
assert os.environ["PJRT_DEVICE"] == "CPU"
print("ok")
