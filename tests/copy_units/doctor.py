# copies: doctor.py
# Check a script before a TPU hour is spent: the static pass names a removed API, --run its crash.
import sys
from pathlib import Path
import doctor
assert "torch" not in sys.modules  # importing the doctor imports neither torch nor the script
Path("old.py").write_text("import torch_xla.core.xla_model as xm\nn = xm.xrt_world_size()\n")
report = doctor.check("old.py")
assert [(f.kind, f.line) for f in report.findings] == [("removed-api", 2)], report.table()
assert report.exit_code == 1 and "torch_xla.runtime.world_size()" in report.table()
report = doctor.check("old.py", run=2, timeout=120)
assert sorted((f.kind, f.line) for f in report.findings) == [("crash", 2), ("removed-api", 2)]
print(report.table())
print("ok")
