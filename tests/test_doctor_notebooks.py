"""The doctor on what users hand it (issue 37): notebooks (code cells read as one program, IPython
lines skipped, findings named by cell and line), files it cannot read (refused, exit status 2,
never "clean"), several files at once (``--static``, for pre-commit and CI), ``%tpu_doctor`` alone
in a notebook, and the static pass's speed."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import REPO
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from tpu_helpers import doctor

pytestmark = pytest.mark.one_line  # reads source only: the static pass imports no torch_xla

CORPUS = REPO / "tests" / "doctor_corpus"
SCRIPTS = [*sorted(CORPUS.glob("*.py")), REPO / "examples" / "port" / "original.py"]
#: IPython-only lines that open every code cell below: none is Python, the doctor must skip them
#: (and "torch_xla" in them must not count as the script mentioning torch_xla).
IPYTHON_LINES = ["%pip install -q torch_xla", "!nvidia-smi", "files = !ls"]


def as_notebook(source: str, path: Path, every: int = 2) -> dict[int, tuple[int, int, int]]:
    """``source`` saved with nbformat as a notebook: code cells of ``every`` top-level statements,
    each opened by IPYTHON_LINES, markdown cells between (so a cell's index in the JSON is not its
    code-cell number). Returns where each script line lands: (code cell, cell index, line)."""
    lines = source.splitlines()
    tops = [min([n.lineno, *(d.lineno for d in getattr(n, "decorator_list", []))])
            for n in ast.parse(source).body]
    cuts = sorted({1, *tops[every::every]}) + [len(lines) + 1]
    nb, where = new_notebook(), {}
    nb.cells.append(new_markdown_cell("# The script as a notebook"))
    for number, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False), 1):
        index = len(nb.cells)
        nb.cells.append(new_code_cell("\n".join(IPYTHON_LINES + lines[a - 1:b - 1])))
        where |= {n: (number, index, n - a + 1 + len(IPYTHON_LINES)) for n in range(a, b)}
        nb.cells.append(new_markdown_cell("Next:"))
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return where


def rows(findings) -> list[tuple]:
    return sorted((f.kind, f.severity, f.message, f.cell, f.cell_index, f.line) for f in findings)


def test_a_script_and_the_same_code_as_a_notebook_give_the_same_findings(tmp_path):
    total = 0
    for script in SCRIPTS:
        notebook = tmp_path / f"{script.stem}.ipynb"
        where = as_notebook(script.read_text(), notebook)
        want = [(f.kind, f.severity, f.message, *where[f.line])
                for f in doctor.check(str(script)).findings]
        got = doctor.check(str(notebook)).findings
        assert rows(got) == sorted(want), script.name
        assert all(set(f.as_json()) >= {"cell", "cell_index", "line"} for f in got)
        total += len(got)
    assert total >= 20  # the corpus's faults, found again in the notebooks


def test_a_notebook_is_one_program_and_its_table_names_cells(tmp_path, capsys):
    """Names defined in one cell are known in later ones (an alias the doctor does not know by
    default; a step function called in another cell's loop)."""
    path = tmp_path / "nb.ipynb"
    nb = new_notebook(cells=[
        new_markdown_cell("# Training"),
        new_code_cell("import torch_xla.core.xla_model as xla_model_mod\nimport torch_xla"),
        new_code_cell("def train_step(x):\n    loss = model(x).sum()\n    loss.backward()\n"
                      "    opt.step()\n    return loss"),
        new_markdown_cell("The loop:"),
        new_code_cell("%%time\nfor x in loader:\n    loss = train_step(x)\n"
                      "    if loss > 3:\n        break\nn = xla_model_mod.xrt_world_size()"),
    ])
    nbformat.write(nb, path)
    found = doctor.check(str(path)).findings
    assert rows(found) == [
        ("host-read-in-loop", "warning", "if tensor in the training step: the host waits for the "
         "device, every step", 3, 4, 4),
        ("removed-api", "error", "xm.xrt_world_size: removed in torch_xla 2.7 (deprecated in 2.5)",
         3, 4, 6)]
    assert doctor.main([str(path)]) == 1
    table = capsys.readouterr().out
    assert "cell 3 (index 4), line 6  error    removed-api" in table, table


def test_ipython_lines_are_skipped_and_lines_stay_put(tmp_path):
    path = tmp_path / "magics.ipynb"
    cells = [  # sources as Jupyter saves them: lists of lines
        "import torch_xla.core.xla_model as xm\n",
        "%%bash\npython -c 'import torch_xla.core.xla_model as xm; xm.xrt_world_size()'\n",
        "%%writefile old.py\nxm.get_ordinal()\n",
        "for i in range(2):\n    !echo {i}\n    out = !ls\n    %time y = 1\nxm?\n??xm\n"
        "%matplotlib inline\nxm.get_ordinal()\n",
        "%%capture\nxm.parse_xla_device('xla:0')\n",
    ]
    path.write_text(json.dumps({"cells": [
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
         "source": src.splitlines(keepends=True)} for src in cells],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 4}))
    found = doctor.check(str(path)).findings
    assert [(f.kind, f.cell, f.cell_index, f.line) for f in found] == [
        ("removed-api", 4, 3, 8), ("removed-api", 5, 4, 2)], found  # no crash: still Python


def test_shell_lines_are_read_for_the_install_and_launch_rules(tmp_path):
    """``!`` lines (with ``\\`` continuations), ``%env`` and ``%%bash`` bodies: installs of the
    torch_xla 1.x era (one finding per block of lines), ``xla_spawn.py --num_cores 8``, XRT
    settings (a note); ``$NAME`` is the notebook's string; other shell lines say nothing."""
    path = tmp_path / "old.ipynb"
    cells = [
        "VERSION = '1.7'\n!nvidia-smi\n!pip install cloud-tpu-client==0.10 \\\n"
        "  https://storage.googleapis.com/tpu-pytorch/wheels/torch_xla-1.7-cp37-cp37m-linux.whl\n"
        "!pip install torch_xla-$VERSION\nimport torch_xla",
        "%env XRT_TPU_CONFIG=localservice;0;localhost:51011\n!pip install -q torch_xla",
        "%%bash\npython transformers/examples/xla_spawn.py --num_cores 8 run_mlm.py",
        "!pip install cloud-tpu-client==0.10",
    ]
    path.write_text(json.dumps({"cells": [
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
         "source": src.splitlines(keepends=True)} for src in cells],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 4}))
    found = [(f.kind, f.severity, f.cell, f.line) for f in doctor.check(str(path)).findings]
    assert found == [("stale-install-pin", "error", 1, 3), ("stale-install-pin", "error", 1, 5),
                     ("stale-env-setting", "info", 2, 1), ("launch-nprocs", "error", 3, 2),
                     ("stale-install-pin", "info", 4, 1)]  # cloud-tpu-client alone: a note


BAD_INPUTS = {  # name -> (bytes, or None for a folder; what the one-line reason says)
    "binary.py": (b"\x7fELF\x02\x01\x01\x00\x00", "binary"),
    "latin1.py": ("print('café')\n".encode("latin-1"), "not UTF-8"),
    "broken.ipynb": (b'{"cells": [', "not a notebook"),
    "empty.ipynb": (b"", "not a notebook"),
    "no_cells.ipynb": (b'{"nbformat": 4}', "not a notebook"),
    "bad_cell.ipynb": (b'{"cells": [{"cell_type": "code", "source": 3}]}', "not a notebook"),
    "folder": (None, "directory"),
    "missing.py": (b"", "No such file"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_what_the_doctor_cannot_read_is_refused_with_exit_status_2(tmp_path, capsys, name):
    data, reason = BAD_INPUTS[name]
    path = tmp_path / name
    if data is None:
        path.mkdir()
    elif name != "missing.py":
        path.write_bytes(data)
    assert doctor.main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and reason in err, (out, err)
    assert err.startswith(f"tpu-doctor: not checked: {path}: ")
    with pytest.raises(doctor.Unreadable):
        doctor.check(str(path))


def test_a_coding_line_is_read_and_run_refuses_notebooks(tmp_path):
    script = tmp_path / "old.py"
    script.write_bytes("# -*- coding: latin-1 -*-\nimport torch_xla.core.xla_model as xm\n"
                       "xm.get_ordinal()  # café\n".encode("latin-1"))
    assert [f.kind for f in doctor.check(str(script)).findings] == ["removed-api"]
    as_notebook(script.read_text("latin-1"), tmp_path / "nb.ipynb")
    with pytest.raises(doctor.Unreadable, match="--run runs scripts"):
        doctor.check(str(tmp_path / "nb.ipynb"), run=2)


def test_static_takes_several_files_and_exits_with_the_worst(tmp_path):
    """The command line as pre-commit and CI call it, in a fresh process."""
    clean, faulty = CORPUS / "dyn_clean.py", CORPUS / "article_custom_dataset.py"
    as_notebook(faulty.read_text(), tmp_path / "faulty.ipynb")
    (tmp_path / "warn.py").write_text("import os\nos.environ['XLA_USE_BF16'] = '1'\n")
    (tmp_path / "bin.py").write_bytes(b"\0\0")

    def run(*files, options=()):
        return subprocess.run([sys.executable, "-m", "tpu_helpers.doctor", *options, "--static",
                               *map(str, files)], capture_output=True, text=True, cwd=REPO,
                              timeout=60)

    cases = {0: [clean, tmp_path / "warn.py"], 1: [clean, faulty, tmp_path / "faulty.ipynb"],
             2: [faulty, tmp_path / "bin.py", clean]}
    for code, files in cases.items():
        proc = run(*files)
        assert proc.returncode == code, (code, proc.stdout, proc.stderr)
        assert [f"== {f} ==" for f in files if f.name != "bin.py"] == [
            line for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert "still obeyed in torch_xla 2.8/2.9" in run(tmp_path / "warn.py").stdout
    assert re.search(r"^ *cell \d+ \(index \d+\), line \d+  error ",
                     run(tmp_path / "faulty.ipynb").stdout, re.M)
    out = json.loads(run(faulty, tmp_path / "bin.py", options=["--json"]).stdout)
    assert set(out) == {"findings", "run", "unreadable"} and list(out["unreadable"]) == [
        str(tmp_path / "bin.py")] and {f["file"] for f in out["findings"]} == {str(faulty)}
    wrong = subprocess.run([sys.executable, "-m", "tpu_helpers.doctor", "--static", str(clean),
                            "--json"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert wrong.returncode == 2 and "files only" in wrong.stderr  # not a file named "--json"


def test_magic_alone_checks_the_notebook_it_runs_in(tmp_path):
    """``%tpu_doctor`` with no argument, in IPython: the notebook VS Code (``__vsc_ipynb_file__``)
    or Jupyter (``__session__``; ``JPY_SESSION_NAME``, a server path: found in the kernel's folder)
    names; with none, a refusal that says how to pass the path."""
    as_notebook((CORPUS / "article_lightning_kb.py").read_text(), tmp_path / "kb.ipynb")
    code = f"""
import os, sys
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
import tpu_helpers.doctor
for name in ("__vsc_ipynb_file__", "__session__"):
    ip.user_ns[name] = {str(tmp_path / "kb.ipynb")!r}
    ip.run_line_magic("tpu_doctor", "")
    print("=== end", name, flush=True)
    del ip.user_ns[name]
os.environ["JPY_SESSION_NAME"] = "some/server/folder/kb.ipynb"
ip.run_line_magic("tpu_doctor", "--json")
print("=== end env", flush=True)
del os.environ["JPY_SESSION_NAME"]
ip.run_line_magic("tpu_doctor", "")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={**{k: v for k, v in os.environ.items(
                              ) if k != "JPY_SESSION_NAME"}, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    vsc, session, env, rest = proc.stdout.split("=== end")
    for out in (vsc, session):
        assert "lightning-removed-arg" in out and "verdict: NOT READY" in out, out
    found = json.loads(env.split("\n", 1)[1])["findings"]
    assert [(f["kind"], f["file"]) for f in found] == [("lightning-removed-arg", "kb.ipynb")]
    assert "verdict" not in rest and "%tpu_doctor NOTEBOOK.ipynb" in proc.stderr, proc.stderr


BLOCK = '''

class Net{i}(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(x)


def make_loader_{i}(ds):
    sampler = DistributedSampler(ds, num_replicas=xr.world_size(), rank=xr.global_ordinal())
    return DataLoader(ds, batch_size=64, sampler=sampler, drop_last=True)


def train_{i}(index, ds):
    device = torch_xla.device()
    model = Net{i}().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = pl.MpDeviceLoader(make_loader_{i}(ds), device)
    for epoch in range(3):
        for step, (x, y) in enumerate(train_loader):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            xm.optimizer_step(opt)
            if loss.item() > 10:
                print("diverged at", step)
        print(f"epoch {{epoch}} done")
    return xm.xrt_world_size()


def evaluate_{i}(model, loader):
    total = 0
    with torch.no_grad():
        for x, y in loader:
            total += (model(x).argmax(1) == y).sum()
    return total'''
HEAD = """import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from torch.utils.data import DataLoader, DistributedSampler"""


def test_static_pass_takes_under_0_3_s_for_a_generated_thousand_line_script(tmp_path):
    """A generated 1,000-line training script (a model, a sharded loader and a training loop with
    a host read and a removed API, over and over), as a script and as a notebook: best of 3."""
    source, blocks = HEAD, 0
    while len(source.splitlines()) < 1000:
        source, blocks = source + BLOCK.format(i=blocks), blocks + 1
    script = tmp_path / "big.py"
    script.write_text(source)
    as_notebook(source, tmp_path / "big.ipynb", every=6)
    for path in (script, tmp_path / "big.ipynb"):
        times, found = [], []
        for _ in range(3):
            start = time.perf_counter()
            found = doctor.check(str(path)).findings
            times.append(time.perf_counter() - start)
        print(f"static pass, {len(source.splitlines())} lines as {path.suffix}: "
              f"best {min(times) * 1e3:.0f} ms of {[round(t * 1e3) for t in times]}")
        assert sorted({f.kind for f in found}) == ["host-read-in-loop", "removed-api"]
        assert len(found) == 2 * blocks and min(times) < 0.3
