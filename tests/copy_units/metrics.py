# copies: metrics.py
# The no-recompile guard around steady training steps; a recompile and a host read it names.
import sys
from metrics import LimitExceeded, track
assert "torch_xla" not in sys.modules  # importing the guard neither starts nor picks a device
import torch, torch_xla
device = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Linear(8, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step(n):
    loss = model(torch.ones(n, 8, device=device)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
    return loss
for _ in range(2):  # warm-up: the first steps compile
    step(4)
with track(max_compiles=0, max_transfers_from_device=0, what="steady steps") as t:
    for _ in range(2):
        step(4)
assert t.counts.compiles == 0 and t.counts.executions == 2, t.explain()
try:
    with track(max_compiles=0, max_transfers_from_device=0, what="a new batch size"):
        print("loss", step(3).item())  # a new shape, and a host read
    raise SystemExit("no LimitExceeded")
except LimitExceeded as exc:
    message = str(exc)
assert message.startswith("a new batch size: 1 compiles (limit 0); 1 device-to-host"), message
assert "1 x item() at <module>" in message and "All counts: {'compiles': 1" in message, message
print("ok")
