# copies: checkpoint.py
# A training state saved to and resumed from a checkpoint folder, on XLA:CPU.
import torch, torch_xla
from checkpoint import CheckpointDir, capture_training_state, restore_training_state
device = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2).to(device)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(3, 4, device=device)).sum().backward()
opt.step()
ckpts = CheckpointDir("run/checkpoints")
ckpts.save(capture_training_state(model, opt, epoch=1, batch_in_epoch=0, step=7), step=7)
state, path = ckpts.load_latest()
fresh = torch.nn.Linear(4, 2).to(device)
where = restore_training_state(state, fresh, torch.optim.AdamW(fresh.parameters()))
assert where.step == 7 and path.name == "step-00000007.pt"
pairs = zip(model.parameters(), fresh.parameters(), strict=True)
assert all(torch.equal(a.cpu(), b.cpu()) for a, b in pairs)
print("ok")
