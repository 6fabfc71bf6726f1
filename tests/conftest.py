"""Shared test setup: every test process uses the local XLA:CPU emulation, one device.

Tests that need another device count or SPMD run a fresh Python in a subprocess (the
device count is fixed at the first XLA use in a process); see ``run_python``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest
import zygote

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # repository tooling (notebook_template, tpu_check)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300,
               check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python (repo root as cwd) and return the finished process:
    forked from a server that imported torch (tests/zygote.py); ``fresh=True`` for code that
    checks what a new interpreter has imported."""
    full_env = {**os.environ, **(env or {})}
    proc = zygote.run(["-c", textwrap.dedent(code)], cwd=REPO, env=full_env, timeout=timeout,
                      fresh=fresh)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_script(folder: Path, name: str, code: str, *args: str,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Write ``code`` to ``folder/name`` and run it there in a fresh Python that can import
    this repository (for scripts that fork or spawn processes, which ``python -c`` cannot
    re-import); fail with its output if it fails."""
    script = folder / name
    script.write_text(code)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    try:
        proc = zygote.run([str(script), *args], cwd=folder, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # with each process's stacks (tests/zygote.py)
        pytest.fail(f"{name} ran over {timeout:.0f} s:\n{(exc.stdout or '')[-3000:]}\n"
                    f"{(exc.stderr or '')[-12000:]}", pytrace=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture
def repo() -> Path:
    return REPO


FORKED_RANKS = """
import ast, json, os, sys
source, logs, rank_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tree = ast.parse(source)
# the worker's own top-level imports (torch, torch_xla, ...: ~5 s of CPU each time), once,
# before the fork; none starts the XLA runtime, which each rank starts for itself
exec(compile(ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                        []), "<imports>", "exec"), {})
code = compile(tree, "<worker>", "exec")


def rank_main(rank):
    log = os.open(f"{logs}{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = ["-c", *rank_args[rank]]
    exec(code, {"__name__": "__main__"})
    sys.exit(0)  # the ordinary interpreter exit, as a rank of its own would end


pids = []
for rank in range(len(rank_args)):
    pid = os.fork()
    if pid == 0:
        rank_main(rank)  # never returns: the rank exits with its own status
    pids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
print("RANK EXIT CODES", *codes)
sys.exit(1 if any(codes) else 0)
"""


def forked_ranks(worker: str, rank_args: list[list[str]], logs: Path, env: dict[str, str],
                 timeout: float = 240) -> list[str]:
    """Run ``worker`` (Python source, as ``python -c``) as one real process per entry of
    ``rank_args`` (its ``sys.argv[1:]``); return each one's output (``<logs><rank>.log``).
    Fails naming the rank that failed, with its output.

    The ranks are forked from one process that ran the worker's top-level imports first (as
    ``torch_xla.launch(start_method="fork")`` starts its replicas): each rank is a process of
    its own that starts its own XLA runtime and process group, without paying the imports
    again."""
    import json

    proc = subprocess.Popen([sys.executable, "-c", FORKED_RANKS, textwrap.dedent(worker),
                             str(logs), json.dumps(rank_args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        launcher = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks
            proc.wait()
    paths = [Path(f"{logs}{r}.log") for r in range(len(rank_args))]
    outputs = [p.read_text() if p.exists() else "(no output)" for p in paths]
    codes = re.search(r"RANK EXIT CODES (.*)", launcher)
    assert codes, f"the rank launcher failed:\n{launcher[-3000:]}"
    for r, code in enumerate(codes.group(1).split()):
        assert code == "0", f"rank {r} failed ({code}):\n{outputs[r][-3000:]}"
    return outputs


def gloo_ranks(worker: str, world: int, folder: Path, *args: str,
               timeout: float = 240) -> list[dict]:
    """Run ``worker`` (Python source) as ``world`` real processes (:func:`forked_ranks`), each
    given its rank, the world size, ``folder`` and ``args``; each writes
    ``folder/report-<rank>.json``. Fails naming the rank that failed; returns the reports in
    rank order."""
    import json

    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "PYTHONPATH": str(REPO)}
    forked_ranks(worker, [[str(r), str(world), str(folder), *args] for r in range(world)],
                 folder / "rank-", env, timeout)
    return [json.loads((folder / f"report-{r}.json").read_text()) for r in range(world)]


STOP_AFTER_LINE = """
import os, runpy, signal, sys

prefix, target, *args = sys.argv[1:]


class StopAfterLine:
    # sys.stdout, except that the process that writes a line starting with ``prefix``
    # stops itself (SIGSTOP) once the line is on the pipe, until the test kills it
    def __init__(self, stream):
        self.stream, self.line = stream, ""

    def write(self, text):
        written = self.stream.write(text)
        *lines, self.line = (self.line + text).split("\\n")
        if any(line.startswith(prefix) for line in lines):
            self.stream.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        return written

    def __getattr__(self, name):
        return getattr(self.stream, name)


sys.stdout = StopAfterLine(sys.stdout)
if target == "-m":  # as python -m (run_module puts the module's path in argv[0])
    sys.argv = args
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)
else:  # as python script.py: the script's folder on sys.path
    sys.argv, sys.path[0] = [target, *args], os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")
"""


def stop_after_line(prefix: str) -> list[str]:
    """``python`` for a test that kills a run when it reads a line starting with ``prefix``
    (append a script or ``-m module`` and its arguments): the process that prints that line
    stops right after it (SIGSTOP), so the kill lands there and not some steps later (the
    test reads the pipe later than the run writes it). A stopped process dies of SIGKILL."""
    return [sys.executable, "-c", STOP_AFTER_LINE, prefix]


def kill_mid_write(folder: Path, code: str, *, ready: str, min_bytes: int,
                   marker: str = ".tmp-") -> tuple[subprocess.Popen[str], list[Path]]:
    """Run ``code`` (argv[1] = ``folder``); once it prints ``ready`` and a temp file
    (``marker`` in its name) in ``folder`` has ``min_bytes``, SIGKILL it. Returns the
    process and the temp files there at the kill (empty: the kill did not land mid-write)."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    temp: list[Path] = []
    try:
        assert proc.stdout.readline().strip() == ready, proc.stderr.read()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if any(p.stat().st_size > min_bytes for p in folder.iterdir() if marker in p.name):
                    break
            except FileNotFoundError:  # renamed into place between the listing and the stat
                pass
            time.sleep(0.002)
        # Freeze it, then look again: the temp files returned are those the kill leaves (a
        # write that ended between the look and the kill would pass for one cut short).
        os.kill(proc.pid, signal.SIGSTOP)
        os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)  # not reaped
        temp = [p for p in folder.iterdir() if marker in p.name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, temp


#: This package's own entries in a venv's site-packages (its editable install included).
OURS = ("tpu_helpers", "__editable__", "_tpu_helpers", "course", "tpu_notebooks_data")


def venv_without_us(root: Path, hide=lambda name: False) -> Path:
    """A new venv (no pip) in ``root`` that sees this venv's packages except this package's own
    and those ``hide(name)`` names; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    links = root / "links"
    links.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not (entry.name.startswith(OURS) or entry.suffix == ".pth" or hide(entry.name)):
            (links / entry.name).symlink_to(entry)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout
    (Path(site.strip()) / "this_venvs_packages.pth").write_text(f"{links}\n")
    return python


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``both_lines`` the tests whose code touches what the torch_xla line can change
    (``tests/lines.py``; not those marked ``one_line``): `make test` runs those on 2.8 too."""
    import lines

    for item in items:
        if (item.path.name.startswith("test_") and item.path.suffix == ".py"
                and item.path.parent == REPO / "tests" and not item.get_closest_marker("one_line")
                and getattr(item, "originalname", item.name) in lines.both_lines(item.path)):
            item.add_marker(pytest.mark.both_lines)
