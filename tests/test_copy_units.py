"""A user copies a toolkit unit into their own project: it must work there alone.

Each unit is copied into a temporary folder outside the repository and imported from there
with ``tpu_helpers`` made unimportable (so a hidden import of a sibling fails), then its
entry point runs on XLA:CPU in that fresh process. Units join this list as the redesign
(issue 14) makes them stand alone; today: ``checkpoint.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import REPO

BLOCK_REPO = """
import sys
sys.modules["tpu_helpers"] = None  # the repository's package is out of reach
sys.path = [p for p in sys.path if p.rstrip("/") != {repo!r}]  # (its venv may live inside)
"""

UNITS = {
    "checkpoint.py": """
import torch, torch_xla
from checkpoint import (CheckpointDir, capture_training_state, load_checkpoint,
                        restore_training_state, UnsafeCheckpointError)
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
assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.parameters(), fresh.parameters()))
print("ok")
""",
}


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_unit_works_copied_alone(unit, tmp_path):
    project = tmp_path / "your_project"
    project.mkdir()
    shutil.copy(REPO / "tpu_helpers" / unit, project / unit)
    code = BLOCK_REPO.format(repo=str(REPO)) + UNITS[unit]
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True,
                          text=True, timeout=300,
                          env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                               "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"
