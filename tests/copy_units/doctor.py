# copies: doctor.py doctor_run.py doctor_static.py doctor_rules.toml
# Check a script before a TPU hour is spent: the static pass names a removed API, --run its crash;
# the three files work next to the script and as a package of the project (tools/).
import shutil, subprocess, sys
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
Path("pkg/tools").mkdir(parents=True)  # no flat copy on this path: the relative import must work
for name in ("doctor.py", "doctor_run.py", "doctor_static.py", "doctor_rules.toml"):
    shutil.copy(name, Path("pkg/tools", name))
proc = subprocess.run([sys.executable, "-m", "tools.doctor", "--run", "2", "--json", "../old.py"],
                      cwd="pkg", capture_output=True, text=True, timeout=180)
assert proc.returncode == 1, proc.stderr[-2000:]
assert '"kind": "crash"' in proc.stdout and '"kind": "removed-api"' in proc.stdout, proc.stdout
print("ok")
