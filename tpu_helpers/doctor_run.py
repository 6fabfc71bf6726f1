"""The doctor's dynamic pass (``--run N``): run a script on XLA:CPU for N optimizer steps, read
torch_xla's own signals (``torch_xla.debug.metrics``, the ``PT_XLA_DEBUG_LEVEL=2`` analysis, the
CPU-fallback tracker) and turn them into :class:`Finding` rows.

Copy it with its sibling ``doctor.py`` (the static pass, the report and the command line, which
import this file). It imports only the standard library and nothing from ``doctor.py``: the child
process loads this very file by path as its start-up hook (``_probe``), where neither a package nor
the sibling is importable; torch_xla is imported only there.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Finding:
    """One row of the report, from either pass (defined here: this file needs nothing else)."""

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


_FRAME = re.compile(r"^\s+(\S+) \((.+):(\d+)\)\s*$")  # "  fn (file:line)", as torch_xla prints it
_SITECUSTOMIZE = """import importlib.util, os, sys
_s = importlib.util.spec_from_file_location("_tpu_doctor_probe", os.environ["TPU_DOCTOR_FILE"])
_m = sys.modules["_tpu_doctor_probe"] = importlib.util.module_from_spec(_s)
_s.loader.exec_module(_m); _m._probe()
"""
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
    out = [Finding("recompiles", "warning", script, line(w), f"{k} compile(s) after warm-up "
                   f"{why}", "one shape per step: drop_last=True, pad to a fixed length or "
                   "buckets; no host reads in the step", "Compilation Analysis (PT_XLA_DEBUG_"
                   "LEVEL=2), torch_xla/csrc/debug_util.cpp") for (w, why), k in seen.items()]
    reads = [w for op, w in tracked if op in _READ_OPS]
    reads += [w for b in blocks[early:] if "tensor value" in " ".join(b["cause"]) and b["kind"]
              != "Compilation" and (w := _user(b["frames"])) not in reads]
    per = run["transfers_per_step"]
    out += [Finding("host-transfers", "warning" if per >= 1 else "info", script, line(w),
                    f"{per} device-to-host transfers per step ({reads.count(w)} from this line)",
                    "read values in xm.add_step_closure every N steps", "TransferFromDeviceTime, "
                    "torch_xla.debug.metrics") for w in {*reads} or ({None} if per else set())]
    ops: dict = {}
    for op, w in tracked:
        ops.setdefault(w, set()).update({op} - set(_READ_OPS))
    out += [Finding("cpu-fallback", "warning", script, line(w), "ran on the CPU (no XLA lowering)"
                    f", every step: aten::{', aten::'.join(sorted(o))}", "an op with a lowering, "
                    "or move it out of the step", "the fallback tracker (XLA_FNTRACKER_FILE), "
                    "torch_xla/csrc/aten_fallback.cpp") for w, o in ops.items() if o]
    return out, run
