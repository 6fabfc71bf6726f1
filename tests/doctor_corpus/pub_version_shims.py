# expect:
# Precision traps that must stay clean (written here, not copied): a shim for torch_xla <= 2.4 in an
# except (ImportError, AttributeError) handler, `getattr(torch_xla, "sync", None) or xm.mark_step`,
# the else of `if HAS_XLA:` choosing CUDA, `device.type != "xla"` and `torch.cuda.is_available()`
# branches, a log buffer read every N steps (or at the last step), `is None`/len() tests. Models
# JackMclaughlin424/csci739-project-mamba tpu_train.py @270a2389baa111b5c80cf91a3162f5cb1d4e3055
# (l.94-100, 895, 1315), apstenku123/nanochat scripts/tpu_simple_train.py
# @11b7408ceb83021893461a38029050db46c40ac3 (l.77, 156) and UCSC-VLAA/CLIPA
# clipa_torch/training/train.py @ebd75e2b7ed9591868d29a26be4383767e3c3d7c (its _HAS_XLA flag).
# ruff: noqa
import torch
import torch_xla.core.xla_model as xm

try:
    import torch_xla
    import torch_xla.runtime as xr

    HAS_XLA = True
    world_size, device_fn = xr.world_size, torch_xla.device
except (ImportError, AttributeError):  # torch_xla <= 2.4, or none at all
    HAS_XLA = False
    world_size, device_fn = xm.xrt_world_size, xm.xla_device
sync = getattr(torch_xla, "sync", None) or xm.mark_step

if HAS_XLA:
    device = device_fn()
else:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train(model, optimizer, loader, steps, log_every):
    if device.type != "xla":
        model.cuda()
    log_buf = []
    for step, (x, y) in enumerate(loader):
        loss = model(x.to(device), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync()
        log_buf.append(loss.detach())
        if step % log_every == 0 or step == steps - 1:  # a read every N steps: a note only
            print(f"step {step}: loss {loss.item():.4f}, {len(log_buf)} buffered")
            log_buf = []
        if loss is None or len(log_buf) > 1000:
            break
        if torch.cuda.is_available():
            torch.cuda.synchronize()
