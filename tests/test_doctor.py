"""The TPU doctor (tpu_helpers/doctor.py, its --run pass doctor_run.py): its corpus, precision
and recall, both passes.

The corpus (issues 27, 37): tests/doctor_corpus/*.py name their expected findings on their first
lines (``# expect: kind@line ...``, ``# expect --run: kind@line ...``): the four articles' code,
scripts that trigger each dynamic finding for real, a fixed loop that must stay clean, the patterns
of 26 public scripts and notebooks (pub_*.py: written here, each naming the public files it
models; their precision traps must stay clean); plus
examples/port/ (the ports must be clean) and the course's notebooks, read as users give them
(``.ipynb``), whose only findings are the faults the notebooks show on purpose (matched by cell
id, so edits to other cells do not move them). Findings of severity "info" are notes, not alarms:
they are not counted.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO

from tpu_helpers import doctor, doctor_run

CORPUS = REPO / "tests" / "doctor_corpus"
PORT = REPO / "examples" / "port"
#: The notebooks' deliberate faults (kind@cell id); every other cell must come out clean.
NOTEBOOKS = {
    "00_environment": [], "04_prediction_gathering": [],
    "06_lightning_on_tpu": ["lightning-removed-arg@a28d965d"],  # Trainer(**{"tpu_cores": 8}), shown
    "07_model_sharding_spmd": [], "09_transformers_variable_length": [],
    "10_bigger_than_one_chip": [], "12_accelerate_and_fsdp_v2": [],
    "13_your_data_to_a_submission": [],
    "01_dataset_setup": ["ragged-batches@nb01-19b"],  # drop_last=False, shown and measured
    "02_parallel_loader": ["ragged-batches@nb02-07"],  # the custom-dataset article's loader
    "03_multicore_training": ["launch-nprocs@259d9cf6"],  # the article's xmp.spawn(nprocs=8)
    "05_performance_debugging": [  # section 4's pitfalls (padding and bincount: --run only)
        "host-read-in-loop@644f656d", "host-read-in-loop@527ae4ff", "ragged-batches@f058499d",
        "dynamic-shape@1f1bf96b", "host-read-in-loop@d9d61893"],
    "11_hugging_face_on_tpu": ["hf-default-optim@nb11-06"],  # section 2: the default Trainer fails
    "08_myths_and_facts": [  # the myths, run to show they fail or warn
        "wrong-backend@nb08-07", "wrong-backend@nb08-09", "launch-nprocs@nb08-20",
        "lightning-removed-arg@nb08-24", "deprecated-api@nb08-26", "deprecated-api@nb08-26"],
}
#: original.py's loss.item() at line 97 runs every --log-interval steps: an info note, not an alarm
#: (test_a_read_every_n_steps_is_a_note_not_an_alarm).
PORT_EXPECTED = {"original.py": ["cuda-only@127", "ragged-batches@130"],
                 "port_minimal.py": [], "port_toolkit.py": []}
#: Floors: the measured values rounded down (68 of 68 alarms right, 68 of 71 faults found), so
#: one more false alarm (68/69) or one more missed fault (67/71) fails this test. The misses are
#: notebook 05's masked indexing and `if` inside loss functions handed to the step as arguments,
#: and pub_helper_meter.py's reads inside a helper method the step calls.
PRECISION_FLOOR, RECALL_FLOOR = 0.99, 0.95
DYNAMIC = sorted(CORPUS.glob("dyn_*.py"))


def expected(path: Path, run: bool = False) -> list[str]:
    head = "# expect --run:" if run else "# expect:"
    line = next(x for x in path.read_text().splitlines()[:3] if x.startswith(head + " ")
                or x == head)
    return line[len(head):].split()


def alarms(findings, where=lambda f: f.line) -> list[str]:
    return [f"{f.kind}@{where(f)}" for f in findings if f.severity != "info"]


def static_cases() -> list[tuple[str, list[str], list[str]]]:
    cases = [(p.name, expected(p), alarms(doctor.static_findings(p.read_text(), str(p))))
             for p in sorted(CORPUS.glob("*.py"))]
    cases += [(f"examples/port/{n}", e, alarms(doctor.static_findings((PORT / n).read_text())))
              for n, e in PORT_EXPECTED.items()]
    for stem, e in NOTEBOOKS.items():  # the public path: the .ipynb itself
        path = REPO / "notebooks" / f"{stem}.ipynb"
        ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
        cases.append((f"notebook {stem}", e, alarms(doctor.check(str(path)).findings,
                                                    lambda f, ids=ids: ids[f.cell_index])))
    return cases


def score(cases) -> tuple[float, float, list[str]]:
    tp = fp = fn = 0
    rows = [f"{'script':42} {'expected':>8} {'found':>6} {'false alarms':>12}"]
    for name, want, got in cases:
        hit = sum((Counter(want) & Counter(got)).values())
        tp, fp, fn = tp + hit, fp + len(got) - hit, fn + len(want) - hit
        rows.append(f"{name:42} {len(want):>8} {hit:>6} {len(got) - hit:>12}")
    return tp / max(tp + fp, 1), tp / max(tp + fn, 1), rows


def test_static_corpus_precision_and_recall():
    precision, recall, rows = score(static_cases())
    print("\n".join(rows), f"\nstatic: precision {precision:.3f}, recall {recall:.3f}")
    assert precision >= PRECISION_FLOOR and recall >= RECALL_FLOOR, "\n".join(rows)


@pytest.mark.parametrize("name", [*PORT_EXPECTED, "dyn_clean.py", "article_lightning_tpu_basic.py"])
def test_port_scripts_and_correct_code_find_exactly_what_is_expected(name):
    path = PORT / name if name in PORT_EXPECTED else CORPUS / name
    found = alarms(doctor.static_findings(path.read_text()))
    assert found == (PORT_EXPECTED.get(name) or []), found


def test_no_false_alarms_on_the_idioms_the_issue_names():
    ok = """
import torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr
from torch.utils.data import DataLoader, DistributedSampler
def _mp_fn(i):
    loader = DataLoader(ds, batch_size=8, drop_last=True,
                        sampler=DistributedSampler(ds, num_replicas=xr.world_size(), rank=0))
    for x, y in loader:
        loss = model(x.to(dev)).sum()
        loss.backward()
        xm.optimizer_step(opt)
        xm.add_step_closure(lambda l: print(l.item()), args=(loss,))
    torch_xla.sync()
    for x, y in eval_loader:  # evaluation after the training loop's sync
        print(float(model(x.to(dev)).sum()), (model(x) > 0).sum().item())
torch_xla.launch(_mp_fn)
"""
    assert doctor.static_findings(ok) == []


def test_static_pass_is_fast_on_a_thousand_lines():
    files = sorted((REPO / "tpu_helpers").glob("*.py"),
                   key=lambda p: -len(p.read_text().splitlines()))
    source = files[0].read_text()  # the toolkit's largest file
    big = source
    for extra in [*files[1:], *sorted(CORPUS.glob("*.py"))]:  # then more real code, to 1,000 lines
        if len(big.splitlines()) >= 1000:
            break
        big += "\n" + extra.read_text()
    assert len(big.splitlines()) >= 1000
    # best of 3, in CPU seconds: the pass's own work, not the other pytest worker's compile
    # (one wall-clock try read 1.09 s in CI; here 70 ms)
    for text in (source, big):
        times = []
        for _ in range(3):
            start = time.process_time()
            doctor.static_findings(text)
            times.append(time.process_time() - start)
        print(f"static pass: {len(text.splitlines())} lines, best {min(times) * 1e3:.0f} ms "
              f"of {[round(t * 1e3) for t in times]}")
        assert min(times) < 1.0


def kinds_at(source: str) -> list[tuple[int, str, str]]:
    return [(f.line, f.kind, f.severity) for f in doctor.static_findings(source)]


def test_a_read_every_n_steps_is_a_note_not_an_alarm():
    """A read under ``if step % N == 0`` (also ``or step == last``) is an info note that says
    "every N steps"; a read under a gate that wraps the optimizer step itself (gradient
    accumulation) still runs every step: a warning."""
    original = doctor.static_findings((PORT / "original.py").read_text())
    note = next(f for f in original if f.line == 97)
    assert (note.kind, note.severity) == ("host-read-in-loop", "info")
    assert "every N steps, not every step" in note.message and "log_interval" in note.message
    src = """import torch_xla.core.xla_model as xm
for step, (x, y) in enumerate(loader):
    loss = loss_fn(model(x), y)
    loss.backward()
    if (step + 1) % accum == 0:
        xm.optimizer_step(opt)
        print(loss.item())
    if step % 10 == 0 or step == last:
        print(f"{loss}")
    if not step % 10:
        print(float(loss))
"""
    assert kinds_at(src) == [(7, "host-read-in-loop", "warning"), (9, "host-read-in-loop", "info"),
                             (11, "host-read-in-loop", "info")]


def test_what_is_not_a_device_read_is_not_reported():
    """``is None``, a length, a shape, a list's truth, Python numbers, an evaluation's floats."""
    src = """import torch_xla.core.xla_model as xm
def train(loader, model, opt):
    losses, total = [], 0.0
    for x, y in loader:
        out = model(x)
        loss = out.loss
        if out is None or loss.shape[0] > 1 or len(losses) > 3 or losses or total > 1:
            continue
        loss.backward()
        xm.optimizer_step(opt)
        total += 1.0
        score = evaluate(model, eval_loader)
        if score > best:
            print(int(total), float(score))
"""
    assert kinds_at(src) == []


def test_branches_not_taken_on_xla_are_not_reported():
    """The else of ``if HAS_XLA``, ``device.type != "xla"``, ``torch.cuda.is_available()``, a
    fallback for an older torch_xla, ``getattr(torch_xla, "sync", None) or xm.mark_step``; a
    CUDA device chosen where a TPU host takes it (no CUDA: the CPU) is still reported."""
    src = """import torch, torch_xla
import torch_xla.core.xla_model as xm
try:
    import torch_xla.runtime as xr
    world = xr.world_size
except (ImportError, AttributeError):
    world = xm.xrt_world_size
sync = getattr(torch_xla, "sync", None) or xm.mark_step
device = torch_xla.device() if HAS_XLA else torch.device("cuda")
if device.type != "xla":
    model.cuda()
if torch.cuda.is_available():
    scaler = torch.cuda.amp.GradScaler()
cpu = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""
    assert kinds_at(src) == [(14, "cuda-only", "error")]


def test_flag_defaults_are_read_before_judging():
    """argparse (store_true, default=), pytorch/xla's args_parse, a function's defaults."""
    src = """import argparse, args_parse, torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp
from torch.utils.data import DataLoader
FLAGS = args_parse.parse_common_options(batch_size=128)
p = argparse.ArgumentParser()
p.add_argument("--cores", type=int, default=8)
p.add_argument("--keep", action="store_false")
args = p.parse_args()
def make(ds, drop=False):
    return DataLoader(ds, batch_size=8, drop_last=drop, shuffle=True)
train_loader = DataLoader(ds, batch_size=8, drop_last=FLAGS.drop_last, shuffle=True)
ok_loader = DataLoader(ds, batch_size=8, drop_last=args.keep, shuffle=True)
xmp.spawn(f, nprocs=FLAGS.num_cores)
xmp.spawn(f, nprocs=args.cores)
"""
    found = {(f.line, f.kind): f for f in doctor.static_findings(src)}
    assert sorted((k, found[k].severity) for k in found) == [
        ((10, "ragged-batches"), "warning"), ((11, "ragged-batches"), "warning"),
        ((13, "launch-nprocs"), "info"), ((14, "launch-nprocs"), "error")]
    assert "drop_last=FLAGS.drop_last (False by default)" in found[11, "ragged-batches"].message
    assert "default 8" in found[14, "launch-nprocs"].message


def test_rank_from_env_matches_the_installed_torch_xla():
    """xmp.spawn's processes get PJRT_LOCAL_PROCESS_RANK/COUNT, never LOCAL_RANK or RANK (those
    are read only under torchrun); a sampler ranked from them is reported."""
    pjrt = ast.unparse(_installed("_internal/pjrt.py"))
    assert "setdefault(xenv.PJRT_LOCAL_PROCESS_RANK" in pjrt
    assert not re.search(r"environ(\[|\.setdefault\()\s*(xenv\.)?'?(LOCAL_)?RANK", pjrt)
    src = """import os, torch_xla
from torch.utils.data.distributed import DistributedSampler
def _mp_fn(index):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    s = DistributedSampler(ds, num_replicas=int(os.environ["WORLD_SIZE"]), rank=rank)
    t = DistributedSampler(ds, num_replicas=world, rank=index)
torch_xla.launch(_mp_fn)
"""
    assert kinds_at(src) == [(5, "rank-from-env", "error")]


def test_stale_settings_are_not_read_by_the_installed_torch_xla():
    """XRT / TPU-Node settings: no Python file of torch_xla and not its _XLAC library names them,
    so the doctor only notes them (info)."""
    root = Path(importlib.util.find_spec("torch_xla").origin).parent
    text = "".join(p.read_text(errors="replace") for p in root.rglob("*.py"))
    lib = next(root.parent.glob("_XLAC.*.so")).read_bytes()
    for key in doctor.STALE:
        assert key not in text and key.encode() not in lib, key
    src = "import os\nos.environ['XRT_TPU_CONFIG'] = 'localservice;0;localhost:51011'\n"
    assert kinds_at(src) == [(2, "stale-env-setting", "info")]


def test_api_table_rows_name_their_source():
    for name, (kind, what, fix, source) in {**doctor.API, **doctor.ENV}.items():
        assert kind in ("removed-api", "deprecated-api") and what and fix, name
        assert re.search(r"v2\.[089]\.0|jax 0\.7\.2", source), (name, source)
    assert "torch_xla.core.xla_model.get_local_ordinal" not in doctor.API  # still in 2.8/2.9


def _installed(relative: str) -> ast.Module:
    """A file of the installed torch_xla, parsed (not imported)."""
    root = Path(importlib.util.find_spec("torch_xla").origin).parent
    return ast.parse((root / relative).read_text())


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_launch_nprocs_rule_matches_the_installed_torch_xla():
    """torch_xla.launch has no nprocs parameter (any nprocs= is a TypeError, even None or 1);
    xmp.spawn takes nprocs and PJRT's spawn raises ValueError unless it is None or 1."""
    launch = _function(_installed("torch_xla.py"), "launch")
    assert [a.arg for a in launch.args.args] == ["fn", "args", "start_method",
                                                "debug_single_process"]
    assert launch.args.kwarg is None and launch.args.vararg is None and not launch.args.kwonlyargs
    spawn = ast.unparse(_function(_installed("_internal/pjrt.py"), "spawn"))
    assert "if nprocs == 1:" in spawn
    assert "elif nprocs is not None:\n        raise ValueError" in spawn
    code = """import torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp
torch_xla.launch(f, nprocs=None)
torch_xla.launch(f, nprocs=1)
torch_xla.launch(f, nprocs=8)
xmp.spawn(f, nprocs=1)
xmp.spawn(f, nprocs=None)
xmp.spawn(f, (), 8)
xmp.spawn(f, nprocs=n)
torch_xla.launch(f)
"""
    found = {f.line: f for f in doctor.static_findings(code)}
    assert sorted(found) == [3, 4, 5, 8, 9] and {f.kind for f in found.values()} == {
        "launch-nprocs"}, found
    assert all("no nprocs parameter: TypeError" in found[n].message for n in (3, 4, 5))
    assert all("ValueError" in found[n].message for n in (8, 9))


# --------------------------------------------------------------------------- torch_xla's text

BLOCK = """
Compilation Analysis: {eq}
Compilation Analysis: Compilation Cause
Compilation Analysis:   most likely user code trying to access tensor value before {sync}
Compilation Analysis: Graph Info:
Compilation Analysis:   Graph Hash: 8fa5ad1cd8ffd91ecab6a2dc9b5b4b8
Compilation Analysis:   Number of Graph Inputs: 4
Compilation Analysis:   Number of Graph Outputs: 1
Compilation Analysis: Python Frame Triggered Execution:
Compilation Analysis:   _local_scalar_dense (/venv/site-packages/torch_xla/_patched.py:9)
Compilation Analysis:   train (/home/me/train.py:42)
Compilation Analysis:   ..........
Compilation Analysis: {dash}
Compilation Analysis: {eq}
pt-xla-profiler: TransferFromDeviceTime too frequent: 3 counts during 2 steps
Unexpected Execution Analysis: Execution Cause
Unexpected Execution Analysis:   user torch_xla.sync
""".format(eq="=" * 80, dash="-" * 80, sync="torch_xla.sync")
TRACKED = """[TAG xla_fallback From Thread 1402]
Python Frames:
  step (/home/me/train.py:17)

C++ Frames:
*** Begin stack trace ***
\tat::_ops::bincount::call(at::Tensor const&, std::optional<at::Tensor> const&, c10::SymInt)
[TAG xla_fallback From Thread 1402]
Frames:
  <module> (/home/me/train.py:30)
C++ Frames:
\tat::_ops::_local_scalar_dense::call(at::Tensor const&)
"""


def test_parsers_read_the_analysis_and_the_fallback_tracker():
    blocks = doctor_run._blocks(BLOCK)
    assert [b["kind"] for b in blocks] == ["Compilation", "Unexpected Execution"]
    first = blocks[0]
    assert first["hash"].startswith("8fa5") and first["inputs"] == 4
    assert "tensor value" in " ".join(first["cause"])
    assert doctor_run._user(first["frames"]) == ("/home/me/train.py", 42)
    assert doctor_run._tracked(TRACKED) == [("bincount", ("/home/me/train.py", 17)),
                                        ("_local_scalar_dense", ("/home/me/train.py", 30))]
    assert doctor_run._blocks("garbage\nCompilation Analysis: Graph Hash: x\n") == []


def test_a_crash_is_reported_with_its_line(tmp_path):
    script = tmp_path / "s.py"
    stderr = (f'Traceback (most recent call last):\n  File "{script}", line 12, in <module>\n'
              f'  File "/venv/site-packages/torch/x.py", line 3, in f\n'
              "AttributeError: module 'torch_xla.core.xla_model' has no attribute "
              "'xrt_world_size'\n")
    crash = doctor_run._crash(stderr, str(script))
    assert (crash.kind, crash.line, crash.severity) == ("crash", 12, "error")
    assert crash.message.endswith("no attribute 'xrt_world_size'")


# --------------------------------------------------------------------------- the dynamic pass


STEPS = 8  # every dynamic run below: 2 warm-up steps and 6 measured
_ROW = re.compile(r"^\s*(\d+)  (error|warning|info)\s+(\S+) ", re.M)  # a row of the table
_RUN = re.compile(r"^run: \d+ steps, \d+ compiles after warm-up, [\d.]+ device-to-host "
                  r"transfers/step, fallback ops ", re.M)


def minus(found: list[str], static: list[str]) -> list[str]:
    """What a report adds to the static pass's alarms: the dynamic pass's."""
    return list((Counter(found) - Counter(static)).elements())


@pytest.fixture(scope="module")
def cli_item():
    """``tpu-doctor --run 8 --json dyn_item.py`` as a user runs it (the corpus counts its
    dynamic findings too: one run of the script, not two)."""
    script = CORPUS / "dyn_item.py"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tpu_helpers.doctor", "--run", str(STEPS),
                           "--json", str(script)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    print(f"--run {STEPS} on {script.name}: {time.perf_counter() - start:.1f} s")
    return proc


@pytest.fixture(scope="module")
def flat_crash(tmp_path_factory):
    """The doctor's files copied flat into a folder with an old script, run there with --run 8
    (the corpus counts its dynamic findings too)."""
    tmp_path = tmp_path_factory.mktemp("flat")
    for name in ("doctor.py", "doctor_run.py", "doctor_static.py", "doctor_rules.toml"):
        shutil.copy(REPO / "tpu_helpers" / name, tmp_path / name)
    shutil.copy(CORPUS / "dyn_crash.py", tmp_path / "old_script.py")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "doctor.py", "--run", str(STEPS), "old_script.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_dynamic_corpus(cli_item, flat_crash):
    """Every dyn_* script (and both port scripts) run for real on XLA:CPU, 8 steps: dyn_item.py
    through the command line and dyn_crash.py through the flat copy (the tests below read
    the same runs), the others through ``dynamic_findings``."""
    cases = []
    for path in [*DYNAMIC, PORT / "port_minimal.py", PORT / "original.py"]:
        static = alarms(doctor.static_findings(path.read_text(), str(path)))
        if path.name == "dyn_item.py":
            out = json.loads(cli_item.stdout)
            found, run = minus([f"{f['kind']}@{f['line']}" for f in out["findings"]
                                if f["severity"] != "info"], static), out["run"]
        elif path.name == "dyn_crash.py":
            rows = [f"{k}@{n}" for n, sev, k in _ROW.findall(flat_crash.stdout) if sev != "info"]
            found = minus(rows, static)
            assert _RUN.search(flat_crash.stdout), flat_crash.stdout  # every field of the run
            run = {"steps", "compiles_after_warmup", "transfers_per_step", "fallback_ops"}
        else:
            findings, run, _notes = doctor.dynamic_findings(str(path), steps=STEPS, timeout=240)
            found = alarms(findings)
        want = expected(path, run=True) if path.parent == CORPUS else []
        cases.append((path.name, want, found))
        assert set(run) == {"steps", "compiles_after_warmup", "transfers_per_step",
                            "fallback_ops"}
    precision, recall, rows = score(cases)
    print("\n".join(rows), f"\ndynamic: precision {precision:.3f}, recall {recall:.3f}")
    assert precision == 1.0 and recall == 1.0, "\n".join(rows)


@pytest.mark.slow
def test_cli_json_schema_and_exit_status(cli_item):
    out = json.loads(cli_item.stdout)
    assert set(out) == {"findings", "run"} and out["run"]["steps"] == STEPS
    assert {tuple(sorted(f)) for f in out["findings"]} == {
        ("file", "fix", "kind", "line", "message", "severity")}
    assert {f["kind"] for f in out["findings"]} <= set(doctor.KINDS)
    assert out["run"]["transfers_per_step"] >= 1 and cli_item.returncode == 0  # warnings only
    bad = subprocess.run([sys.executable, "-m", "tpu_helpers.doctor",
                          str(CORPUS / "article_custom_dataset.py")], capture_output=True,
                         text=True, cwd=REPO)
    assert bad.returncode == 1 and bad.stdout.strip().splitlines()[-2].startswith(
        "verdict: NOT READY")


def test_console_script_points_at_main():
    text = (REPO / "pyproject.toml").read_text()
    assert 'tpu-doctor = "tpu_helpers.doctor:main"' in text
    assert doctor.main(["--json", str(CORPUS / "dyn_clean.py")]) == 0


def test_ipython_magic(tmp_path):
    code = ("import sys\nassert 'IPython' not in sys.modules\n"
            "import tpu_helpers.doctor\nassert 'IPython' not in sys.modules\n"
            "from IPython.core.interactiveshell import InteractiveShell\n"
            "ip = InteractiveShell.instance()\nimport importlib\n"
            "importlib.reload(tpu_helpers.doctor)\n"
            f"ip.run_line_magic('tpu_doctor', {str(CORPUS / 'article_lightning_kb.py')!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lightning-removed-arg" in proc.stdout and "verdict: NOT READY" in proc.stdout


@pytest.mark.slow
def test_doctor_pair_copied_flat_runs_both_passes(flat_crash):
    proc = flat_crash
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.search(r"^\s+12\s+error\s+crash .*xrt_world_size", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\s+12\s+error\s+removed-api", proc.stdout, re.M)


#: What two rules of the catalogue say they measured, measured: a sync between backward() and the
#: optimizer step runs each step as two graphs (sync-before-step), and torch_xla.device(n) with an
#: index above 0 raises IndexError in a process with one device (xla-device-index).
TWO_GRAPHS = r"""
import json, torch, torch_xla, torch_xla.debug.metrics as met
import torch_xla.core.xla_model as xm
torch.manual_seed(0)
model = torch.nn.Linear(8, 2).to(torch_xla.device())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 8).to(torch_xla.device())
out = {}
for between in (False, True):
    def step():
        model(x).square().mean().backward()
        if between:
            torch_xla.sync()
        optimizer.step(); optimizer.zero_grad(); torch_xla.sync()
    for _ in range(3):  # warm-up: the compiles
        step()
    xm.wait_device_ops()  # executions are counted when they end
    before = met.metric_data("ExecuteTime")[0]
    for _ in range(5):
        step()
    xm.wait_device_ops()
    out[str(between)] = (met.metric_data("ExecuteTime")[0] - before) / 5
try:
    xm.xla_device(1)
except IndexError as exc:
    out["index"] = f"IndexError: {exc}"
out["devices"] = len(torch_xla.devices())
print("RESULT " + json.dumps(out))
"""


def test_the_sync_and_device_index_rules_say_what_torch_xla_does():
    from conftest import run_python
    proc = run_python(TWO_GRAPHS, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})
    out = json.loads(proc.stdout.split("RESULT ")[-1])
    print(out)
    assert out["False"] == 1.0 and out["True"] == 2.0  # graph executions per step
    assert out["devices"] == 1 and out["index"] == "IndexError: list index out of range"
    source = "import torch_xla\nd = torch_xla.device(xr.global_ordinal())\ne = torch_xla.device()\n"
    assert [(f.kind, f.line) for f in doctor.static_findings(source)] == [("xla-device-index", 2)]


def test_call_rules_are_data_and_a_needed_version_below_is_skipped(monkeypatch):
    """The Hugging Face rules need transformers >= 5 (what they were measured with): a rule that
    needs a version newer than the installed one does not fire (installed here: 5.x)."""
    import importlib.metadata
    major = int(importlib.metadata.version("transformers").split(".")[0])
    source = "from transformers import TrainingArguments\nTrainingArguments(output_dir='o')\n"
    assert [f.kind for f in doctor.static_findings(source)] == ["hf-default-optim"]
    rule = next(r for r in doctor_run.CALLS if r["kind"] == "hf-default-optim")
    assert rule["needs"] == ["transformers", 5] and major >= 5
    monkeypatch.setitem(rule, "needs", ["transformers", major + 1])  # the catalogue edited
    assert doctor.static_findings(source) == []


def test_every_kind_in_the_catalogue_is_found_somewhere_in_the_corpus():
    """doctor_rules.toml's kinds each fire on some corpus file or notebook (the --run kinds: the
    dyn_ files' `expect --run` lines), so no rule text is left without a rule."""
    found = {e.split("@")[0] for p in sorted(CORPUS.glob("*.py")) for run in (False, True)
             if not run or p in DYNAMIC for e in expected(p, run)}
    found |= {e.split("@")[0] for faults in NOTEBOOKS.values() for e in faults}
    missing = set(doctor_run.KINDS) - found - {"stale-env-setting"}  # notes: not in `expect`
    assert not missing, f"kinds no corpus file expects: {sorted(missing)}"
