# copies: hang_watchdog.py
# Your own loop under torch_xla.launch, no launcher of ours (a Kaggle kernel): each replica ticks
# its progress; rank 0's monitor thread names the replica that stopped, where, and ends the run.
import os, tempfile, time
from concurrent.futures.process import BrokenProcessPool
import torch, torch_xla
import hang_watchdog as watchdog
folder = tempfile.mkdtemp()

def my_loop(rank):
    watchdog.start(folder, rank, world=1, min_timeout=1.0, poll=0.2)
    for step in range(1, 40):
        watchdog.tick(step - 1, "data")
        if step == 6:
            time.sleep(10**6)  # a batch that never comes
        torch.ones(4, device=torch_xla.device()).add_(step)
        watchdog.tick(step, "step")
        torch_xla.sync()

err = os.path.join(folder, "stderr")
saved = os.dup(2)
os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)  # the report goes to stderr
try:
    torch_xla.launch(my_loop, start_method="fork")
    raise AssertionError("the hang was not stopped")
except BrokenProcessPool:
    pass
finally:
    os.dup2(saved, 2)
report = open(err).read()
assert "no progress for longer than 1.0 s" in report, report
assert [row for row in report.splitlines() if row.split()[:3] == ["0", "5", "data"]], report
assert "in my_loop" in report, report
print("ok")
