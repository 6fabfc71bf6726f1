# copies: train.py launch.py checkpoint.py data.py
# The per-replica training on fake data for a few steps (torch_xla.launch, XLA:CPU), then the
# same file as a script, resuming from the checkpoint the first run left.
import json, subprocess, sys
from pathlib import Path
from train import Config, train
history = train(Config(epochs=1, max_steps=3, log_every=1, out_dir="run"))
assert history["total_steps"] == 3 and [r["step"] for r in history["log"]] == [1, 2, 3]
assert Path("run/checkpoints/step-00000003.pt").is_file()
proc = subprocess.run([sys.executable, "train.py", "--max-steps", "5", "--out-dir", "run"],
                      capture_output=True, text=True, timeout=240)
assert proc.returncode == 0, proc.stderr[-2000:]
assert "resumed from step-00000003.pt" in proc.stdout, proc.stdout
assert json.loads(Path("run/history.json").read_text())["total_steps"] == 5
print("ok")
