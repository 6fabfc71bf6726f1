"""The doctor's run and frame: the ``--run N`` pass (torch_xla's metrics, PT_XLA_DEBUG_LEVEL=2 and
fallback tracker over N steps on XLA:CPU), the catalogue, the reader, the report, the command line.
Nothing from ``doctor.py`` or ``doctor_static.py`` (the static pass's rules): the child loads this
file alone (``_probe``)."""

from __future__ import annotations

import argparse
import atexit
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import tomllib


@dataclass
class Finding:  # one row of the report, from either pass (here: this file needs nothing else)
    kind: str
    severity: str  # "error" | "warning" | "info"
    file: str
    line: int
    message: str
    fix: str
    source: str = ""  # where the rule was read (the human table only)
    cell: int | None = None  # a notebook's: the code cell (1 = its first), `line` within it,
    cell_index: int | None = None  # and that cell's index among all its cells (the JSON's, from 0)

    def as_json(self) -> dict:
        keys = ("kind", "severity", "file", "line", "message", "fix")
        return {k: getattr(self, k) for k in keys + ("cell", "cell_index") * bool(self.cell)}


# --------------------------------------------------------------------------- the catalogue
#: doctor_rules.toml, beside this file: each kind's severity, text, fix and source; the names and
#: settings torch_xla 2.8/2.9 changed; the call rules (tomllib: Python >= 3.11).
_CAT = tomllib.loads(Path(__file__).with_name("doctor_rules.toml").read_text().replace(
    "{tags}", TAGS := "pytorch/xla v2.8.0 and v2.9.0"))
XM, STALE, CALLS = "torch_xla.core.xla_model", set(_CAT["stale"]), _CAT["calls"]
API, ENV = ({k: tuple(v) for k, v in _CAT[t].items()} for t in ("api", "env"))
RULES = {k: tuple(r[f] for f in ("severity", "what", "fix", "source") if f in r) + ("",) * (
    "source" not in r and "what" in r) for k, r in _CAT["rules"].items()}
KINDS = tuple(RULES)


def finding(kind: str, file: str, line: int, what: str, note=None, sev=None) -> Finding:
    return Finding(kind, note and "info" or sev or RULES[kind][0], file, line, note or RULES[
        kind][1].format(what), *RULES[kind][2:])  # note: an info with that text; sev: another


_FRAME = re.compile(r"^\s+(\S+) \((.+):(\d+)\)\s*$")  # "  fn (file:line)", as torch_xla prints it
_SITECUSTOMIZE = ("import importlib.util as u, os, sys\n_s = u.spec_from_file_location('_tpu_"
                  "doctor_probe', os.environ['TPU_DOCTOR_FILE'])\n_m = sys.modules[_s.name] = u."
                  "module_from_spec(_s)\n_s.loader.exec_module(_m); _m._probe()\n")  # the child's
_READ_OPS = ("_local_scalar_dense", "item")  # .item(): a transfer, not a fallback
_FILES = ("PT_XLA_DEBUG_FILE", "XLA_FNTRACKER_FILE")


def _probe() -> None:
    """In the child (its sitecustomize): torch_xla's counters at each optimizer step, appended to
    ``TPU_DOCTOR_OUT/<pid>.jsonl``; after N steps it stops its whole process group."""
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:
        return
    state, limit = {"steps": 0}, int(os.environ["TPU_DOCTOR_STEPS"])

    def snap(event: str) -> None:
        rec = {"event": event, "step": state["steps"], **{k: os.path.getsize(os.environ[k]) if (
            os.path.exists(os.environ[k])) else 0 for k in _FILES}}
        if "torch_xla" in sys.modules:
            import torch_xla.debug.metrics as met
            count = lambda m: int((met.metric_data(m) or (0,))[0])
            rec.update(compiles=count("CompileTime"), transfers=count("TransferFromDeviceTime"),
                       executions=count("ExecuteTime") + count("ExecuteReplicatedTime"),
                       fallbacks={n: int(met.counter_value(n)) for n in met.counter_names()
                                  if n.startswith("aten::") and n[6:] not in _READ_OPS})
        with open(Path(os.environ["TPU_DOCTOR_OUT"]) / f"{os.getpid()}.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def hook(optimizer, args, kwargs) -> None:
        state["steps"] += 1
        if state["steps"] == 1:
            atexit.register(snap, "exit")  # registered after torch_xla's: runs before it
        if state["steps"] > limit:
            if "torch_xla" in sys.modules:
                sys.modules["torch_xla"].core.xla_model.wait_device_ops()
            state["steps"] -= 1
            snap("stop")
            os.killpg(os.getpgrp(), signal.SIGKILL)
        snap("step")

    register_optimizer_step_post_hook(hook)


def _blocks(text: str) -> list[dict]:
    """torch_xla's ``Compilation/Execution Analysis:`` blocks (``debug_util.cpp``), in order."""
    blocks, cur = [], None
    for line in text.splitlines():
        m = re.match(r"(Compilation|Execution|Unexpected Execution) Analysis: ?(.*)", line)
        body = m.group(2) if m else ""
        if m and body.strip() in ("Compilation Cause", "Execution Cause"):
            blocks.append(cur := {"kind": m.group(1), "cause": [], "hash": "", "inputs": -1,
                                  "frames": []})
        elif m and cur is not None and m.group(1) == cur["kind"]:
            if h := re.search(r"Graph Hash: (\w+)", body):
                cur["hash"] = h.group(1)
            elif i := re.search(r"Number of Graph Inputs: (\d+)", body):
                cur["inputs"] = int(i.group(1))
            elif f := _FRAME.match(body):
                cur["frames"].append((f.group(2), int(f.group(3))))
            elif not cur["hash"] and body.startswith("  ") and not cur["frames"]:
                cur["cause"].append(body.strip())
    return blocks


def _tracked(text: str) -> list[tuple[str, tuple[str, int] | None]]:
    """The fallback tracker's ``[TAG xla_fallback ...]`` entries: (aten op, the user's frame)."""
    out = []
    for chunk in text.split("[TAG ")[1:]:
        py, _, cpp = chunk.partition("C++ Frames")
        op = re.search(r"at::_ops::(\w+)::", cpp)
        frames = [(m.group(2), int(m.group(3))) for m in map(_FRAME.match, py.splitlines()) if m]
        out.append((op.group(1) if op else "?", _user(frames)))
    return out


def _user(frames: list[tuple[str, int]]) -> tuple[str, int] | None:
    lib = ("-packages", "<frozen", f"{sys.prefix}/lib", f"{sys.base_prefix}/lib")
    return next((f for f in frames if not any(s in f[0] for s in lib)), None)


def _crash(stderr: str, file: str) -> Finding:
    frames = [(m[1], int(m[2])) for m in re.finditer(r'File "([^"]+)", line (\d+)', stderr)]
    here = [f for f in frames if os.path.abspath(f[0]) == os.path.abspath(file)] or [
        f for f in frames if _user([f])]
    errors = re.findall(r"^((?:\w+\.)*\w*(?:Error|Exception|Exit)\b.*)$", stderr, re.M)
    return Finding("crash", "error", file, here[-1][1] if here else 0, "the script crashed: " + (
        errors[-1] if errors else stderr.strip()[-300:]), "fix this line first")


def dynamic_findings(script: str, args=(), steps: int = 10, timeout: float = 300,
                     warmup: int = 2) -> tuple[list[Finding], dict, list[str]]:
    """Run ``script`` on XLA:CPU for ``steps`` optimizer steps: (findings, run, notes)."""
    with tempfile.TemporaryDirectory(prefix="tpu_doctor_") as tmp:
        Path(tmp, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        files = {"PT_XLA_DEBUG_FILE": f"{tmp}/analysis.txt", "XLA_FNTRACKER_FILE": f"{tmp}/fb.txt"}
        env = {**os.environ, **files, "PJRT_DEVICE": "CPU", "PT_XLA_DEBUG": "1",
               "PT_XLA_DEBUG_LEVEL": "2", "XLA_FNTRACKER_LIST": "xla_fallback",
               "TPU_DOCTOR_FILE": os.path.abspath(__file__), "TPU_DOCTOR_OUT": tmp,
               "TPU_DOCTOR_STEPS": str(steps), "PYTHONPATH": os.pathsep.join(
                   filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        child = subprocess.Popen([sys.executable, script, *args], env=env, text=True,
                                 start_new_session=True, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
        try:
            notes, stderr = [], child.communicate(timeout=timeout)[1]
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            notes, stderr = [f"note: stopped at the {timeout:.0f} s limit"], child.communicate()[1]
        runs = [[json.loads(x) for x in p.read_text().splitlines()]
                for p in Path(tmp).glob("*.jsonl")]
        recs = max(runs, key=lambda r: (max(x["step"] for x in r), len(r)), default=[])
        crashed = child.returncode not in (0, None) and all(r["event"] != "stop" for r in recs)
        found, run = _analyse(recs, warmup, script, files, notes)
    return ([_crash(stderr, script)] if crashed else []) + found, run, notes


def _analyse(recs, warmup, script, files, notes) -> tuple[list[Finding], dict]:
    """Findings and the ``run`` summary from the probe's records and torch_xla's two files."""
    done = lambda r: r["step"] - (r["event"] == "step")  # steps finished when it was taken
    end = next((r for r in recs if r["event"] != "step"), recs[-1] if recs else {
        "event": "none", "step": 0})
    base = next((r for r in recs if r["event"] == "step" and done(r) >= min(
        warmup, done(end) - 1)), end)
    n, get = max(done(end) - done(base), 1), lambda r, k: r.get(k, 0)
    run = {"steps": get(end, "step"), "compiles_after_warmup": get(end, "compiles") - get(
        base, "compiles"), "transfers_per_step": round((get(end, "transfers") - get(
            base, "transfers")) / n, 2), "fallback_ops": end.get("fallbacks", {})}
    if "compiles" not in end:
        notes.append("note: no optimizer step ran on an XLA device (torch_xla was not used)"
                     if recs else "note: no optimizer step ran before the script ended")
        return [], run
    text = lambda k, a, b: Path(files[k]).read_bytes()[a:b].decode(errors="replace") if (
        os.path.exists(files[k])) else ""  # what torch_xla wrote between two records
    blocks = _blocks(text(_FILES[0], 0, end[_FILES[0]]))
    early = len(_blocks(text(_FILES[0], 0, base[_FILES[0]])))
    tracked = _tracked(text(_FILES[1], base[_FILES[1]], end[_FILES[1]]))
    notes.append(f"run: {(end['executions'] - base['executions']) / n:.1f} executions/step after"
                 f" warm-up ({n} steps measured)")
    line = lambda w: (w or ("", 0))[1]
    seen: Counter = Counter()  # (the user's frame, cause: why) -> compiles after warm-up
    for i, b in enumerate(blocks[early:], early):
        if b["kind"] != "Compilation":
            continue
        where, cause = _user(b["frames"]), " ".join(b["cause"])
        same = [o for o in blocks[:i] if o["kind"] == "Compilation" and _user(o["frames"]) == where]
        seen[where, f"({cause}): " + (
            "the same graph with new input shapes (a ragged or padded batch?)"
            if any(o["inputs"] == b["inputs"] and o["hash"] != b["hash"] for o in same) else
            "a host read cut the graph here" if "tensor value" in cause else
            "a different graph was traced (a Python branch, a new shape or a cut)")] += 1
    out = [finding("recompiles", script, line(w), f"{k} compile(s) after warm-up {why}")
           for (w, why), k in seen.items()]
    reads = [w for op, w in tracked if op in _READ_OPS]
    reads += [w for b in blocks[early:] if "tensor value" in " ".join(b["cause"]) and b["kind"]
              != "Compilation" and (w := _user(b["frames"])) not in reads]
    per = run["transfers_per_step"]
    out += [finding("host-transfers", script, line(w), f"{per} device-to-host transfers per step"
                    f" ({reads.count(w)} from this line)", sev=None if per >= 1 else "info")
            for w in {*reads} or ({None} if per else set())]
    ops: dict = {}
    for op, w in tracked:
        ops.setdefault(w, set()).update({op} - set(_READ_OPS))
    out += [finding("cpu-fallback", script, line(w), "aten::" + ", aten::".join(sorted(o)))
            for w, o in ops.items() if o]
    return out, run


# --------------------------------------------------------------------------- reading files
class Unreadable(ValueError):
    """Neither Python nor a notebook (or no such file): the command line exits 2 with the reason."""


_IPYTHON = re.compile(r"(\s*)((\w+\s*=\s*)?[%!].*|\??[\w.]+\?\??|\?\??[\w.]+)\s*")  # %, !, x?
_SHELL = re.compile(r"\s*(?:\w+\s*=\s*)?(?:!|%(?=(?:pip|conda|env|system|sx)\b))\s*(.*)")
_PY_BODY = {"time", "timeit", "capture", "prun"}  # %%magics whose body is Python run in the kernel


def read_source(path: str) -> tuple[str, list[tuple[int, int, int]] | None, dict[int, str]]:
    """A script's text; or a notebook's code cells as one program (IPython lines: ``pass``, blank;
    lines stay), per line (code cell number, cell index, line in the cell), and its shell lines."""
    try:
        data = Path(path).read_bytes()
        if b"\0" in data:
            raise Unreadable("a binary file (NUL bytes), neither Python nor a notebook")
        text = data.decode(tokenize.detect_encoding(io.BytesIO(data).readline)[0])
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:  # OSError: missing, a directory...
        raise Unreadable(getattr(exc, "strerror", 0) or f"not UTF-8 (or its coding line's): {exc}"
                         ) from None
    if not path.endswith(".ipynb"):
        return text, None, {}
    try:
        cells = [(i, "".join(c["source"])) for i, c in enumerate(json.loads(text)["cells"])
                 if c["cell_type"] == "code"]  # a source is a string or a list of strings
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON's errors: ValueError
        raise Unreadable(f"not a notebook (JSON, a cells list): {type(exc).__name__}: {exc}"
                         ) from None
    lines, where, shell, cont = [], [], {}, 0
    for number, (index, source) in enumerate(cells, 1):
        body = re.split(r"\r\n?|\n", source)
        magic = re.match(r"%%(\w+)", body[0])
        for n, line in enumerate(body, 1):
            where.append((number, index, n))  # a shell line: !cmd, %pip..., %%bash; "\\" goes on
            sh = None if cont or magic and magic[1] not in _PY_BODY else _SHELL.fullmatch(line)
            if cont or sh or magic and n > 1 and magic[1] in ("bash", "sh", "script"):
                key = cont or len(lines) + 1
                shell[key] = f"{shell.get(key, '')} {sh[1] if sh else line}".strip().rstrip("\\")
            ipy = _IPYTHON.fullmatch(line)
            lines.append("" if cont or magic and (n == 1 or magic[1] not in _PY_BODY) else
                         ipy[1] + "pass" if ipy else line)
            cont = (cont or len(lines)) if (cont or sh) and line.rstrip().endswith("\\") else 0
    return "\n".join(lines), where, shell


_OLD, _SYSTEM = _CAT["patterns"]["old_install"], _CAT["patterns"]["system"]  # 1.x installs; !


def shell_findings(text: str, shell: dict[int, str], file: str) -> list[Finding]:
    """Shell lines (a notebook's, ``get_ipython().system(...)``, ``os.system(...)``, jupytext's
    ``# !...``): 1.x-era installs, ``xla_spawn.py --num_cores N``, XRT settings (export, %env)."""
    at, strs = lambda m: text.count("\n", 0, m.start()) + 1, dict(re.findall(  # noqa: E731
        r"^(\w+) *= *['\"]([^'\"]*)['\"]", text, re.M))  # expanded in !lines: $NAME, {NAME}
    lines = {**shell, **{at(m): m[2] for m in re.finditer(_SYSTEM, text)}}
    lines |= {at(m): m[1] for m in re.finditer(r"^# ?(?:!|%pip) ?(.*)$", text, re.M)
              } if "\n# %%" in text else {}
    out, rule = [], lambda k, n, w, note=None: finding(k, file, n, w, note)  # noqa: E731
    for n, cmd in sorted(lines.items()):
        cmd = re.sub(r"\$\{?(\w+)\}?|\{(\w+)\}", lambda m: strs.get(m[1] or m[2], m[0]), cmd)
        if old := re.findall(_OLD, cmd):
            what = next((o for o in old if o[:5] != "cloud"), None)
            out.append(rule("stale-install-pin", n, what or old[0], None if what else "cloud-tpu-"
                            "client: the TPU-Node client; torch_xla 2.x does not use it"))
        if (m := re.search(r"xla_spawn\.py.*--num_cores[= ](\d+)", cmd)) and m[1] != "1":
            out.append(rule("launch-nprocs", n, f"xla_spawn.py --num_cores {m[1]}: its xmp.spawn("
                            f"nprocs={m[1]}) raises ValueError (None or 1 only)"))
        out += [rule("stale-env-setting", n, k) for k in re.findall(r"\b(\w+)=", cmd) if k in STALE]
    return out


def this_notebook() -> str:
    """This kernel's notebook, as VS Code or Jupyter name it; :class:`Unreadable` if none does."""
    ip = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    ns, env = getattr(ip, "user_ns", {}), os.getenv("JPY_SESSION_NAME")
    for name in map(str, filter(None, (ns.get("__vsc_ipynb_file__"), ns.get("__session__"), env))):
        for path in (Path(name), Path(Path(name).name)):  # as named, or in the cwd
            if path.suffix == ".ipynb" and path.is_file():
                return str(path)
    raise Unreadable("nothing names this notebook here (__vsc_ipynb_file__, __session__, "
                     "JPY_SESSION_NAME): save it and pass its path: %tpu_doctor NOTEBOOK.ipynb")


# --------------------------------------------------------------------------- the report
@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    run: dict | None = None
    notes: list[str] = field(default_factory=list)

    exit_code = property(lambda self: int(any(f.severity == "error" for f in self.findings)))

    def table(self) -> str:
        """Line (or cell and line), severity, kind, finding; fix, source; the run; the verdict."""
        at = lambda f: f"cell {f.cell} (index {f.cell_index}), line {f.line}" if f.cell else f.line
        w = max([5, *(len(str(at(f))) for f in self.findings)])
        pad = " " * (w + 34)
        rows = [f"{'line' if w == 5 else 'where':>{w}}  {'severity':8} {'kind':23} finding"]
        for f in sorted(self.findings, key=lambda f: (f.cell or 0, f.line, f.kind)):
            rows += [f"{at(f):>{w}}  {f.severity:8} {f.kind:23} {f.message}", f"{pad}fix: {f.fix}"]
            rows += [f"{pad}source: {f.source}"] if f.source else []
        if r := self.run:
            rows.append(f"run: {r['steps']} steps, {r['compiles_after_warmup']} compiles after "
                        f"warm-up, {r['transfers_per_step']} device-to-host transfers/step, "
                        f"fallback ops {r['fallback_ops'] or 'none'}")
        e, w = (sum(f.severity == s for f in self.findings) for s in ("error", "warning"))
        return "\n".join(rows + self.notes + ["verdict: " + _CAT["verdict"][
            "error" if e else "warning" if w else "clean"].format(e=e, w=w)])


# --------------------------------------------------------------------------- entry points' bodies
def checked(static, script: str, args=(), run: int | None = None, timeout: float = 300) -> Report:
    """``static(source, file, shell)``'s findings (a notebook's: cell, line); then ``run`` steps."""
    source, where, shell = read_source(script)
    if run and where is not None:
        raise Unreadable("--run runs scripts: export the notebook first (jupyter nbconvert --to "
                         "script), or run the static pass")
    report = Report(static(source, script, shell))
    if where is not None:
        at = lambda line: where[min(max(line, 1), len(where)) - 1]
        report.findings = [replace(f, cell=c, cell_index=i, line=n)
                           for f in report.findings for c, i, n in [at(f.line)]]
    if run:
        found, report.run, report.notes = dynamic_findings(script, args, run, timeout)
        report.findings += found
    return report


def command_line(check, argv: list[str] | None, description: str) -> int:  # check(): doctor.py's
    p = argparse.ArgumentParser(prog="tpu-doctor", description=description)
    p.add_argument("--run", type=int, metavar="N", help="also run N optimizer steps on XLA:CPU")
    p.add_argument("--timeout", type=float, default=300, help="seconds for --run (default 300)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--static", action="store_true", help="only the static pass, on every file")
    p.add_argument("script", nargs="?", help="a .py script or a .ipynb notebook")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (--static: more files)")
    a = p.parse_args(argv)
    if a.script is None and "IPython" not in sys.modules or a.static and (a.run or any(
            x.startswith("-") for x in a.args)):
        p.error("give a script or notebook (--static: files only, after the options; no --run)")
    start, reports, bad = time.perf_counter(), {}, {}
    files = [a.script, *a.args] if a.static else [a.script]
    for file in files:
        try:
            file = file or this_notebook()
            reports[file] = check(file, () if a.static else a.args, a.run, a.timeout)
        except Unreadable as exc:
            bad[file or "this notebook"] = str(exc)
            print(f"tpu-doctor: not checked: {file or 'this notebook'}: {exc}", file=sys.stderr)
    if a.json:
        out = {"findings": [f.as_json() for r in reports.values() for f in r.findings],
               "run": next((r.run for r in reports.values()), None)}
        print(json.dumps(out | ({"unreadable": bad} if bad else {}), indent=1))
    elif reports:
        print("\n".join(f"== {f} ==\n" * (len(files) > 1) + r.table() for f, r in reports.items()))
        print(f"({time.perf_counter() - start:.1f} s)")
    return 2 if bad else int(any(r.exit_code for r in reports.values()))
