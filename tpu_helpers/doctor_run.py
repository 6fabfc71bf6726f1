"""The doctor's run and frame: the dynamic pass (``--run N``: N optimizer steps on XLA:CPU, read in
torch_xla's metrics, its PT_XLA_DEBUG_LEVEL=2 analysis and fallback tracker), the findings'
catalogue, the reader of scripts and notebooks (and their shell lines' checks), the report and the
command line's body. Copy it with ``doctor.py``; standard library only, nothing from ``doctor.py``:
the child loads this very file as its start-up hook (``_probe``), torch_xla only there."""

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
XM, TAGS = "torch_xla.core.xla_model", "pytorch/xla v2.8.0 and v2.9.0"
_R, _D = "removed-api", "deprecated-api"
_XM, _GONE = f"torch_xla/core/xla_model.py at {TAGS}", f"absent from xla_model.py at {TAGS}"
_2_7 = "removed in torch_xla 2.7 (deprecated in 2.5)"  # xla_model.py at v2.5.1: l.43-50
#: qualified name -> (kind, what changed, the fix, where it was read: checked at the tags).
API = {
    f"{XM}.xrt_world_size": (_R, _2_7, "torch_xla.runtime.world_size()", _GONE),
    f"{XM}.get_ordinal": (_R, _2_7, "torch_xla.runtime.global_ordinal()", _GONE),
    f"{XM}.parse_xla_device": (_R, _2_7, "torch.device(s).index", _GONE),
    "torch_xla.distributed.xla_dist": (_R, "removed in torch_xla 2.1", "torch_xla.launch on each "
                                       "host", f"in v2.0.0, absent at {TAGS}"),
    "torch_xla.experimental.pjrt": (_R, "not in torch_xla 2.8/2.9", "torch_xla.runtime",
                                    f"no torch_xla/experimental/pjrt.py at {TAGS}"),
    "torch_xla.experimental.xla_sharding": (_R, "not in torch_xla 2.8/2.9", "torch_xla.distribu"
                                            "ted.spmd", f"no xla_sharding.py at {TAGS}"),
    "torch_xla.amp.GradScaler": (_R, "removed in torch_xla 2.9 (in 2.8)", "none: bfloat16 needs no"
                                 " loss scaling", "torch_xla/amp/__init__.py at v2.8.0 vs v2.9.0"),
    "jax.experimental.maps": (_R, "removed from JAX; torch_xla never used it", "torch_xla.launch"
                              " or SPMD", "jax 0.7.2 (Colab/Kaggle TPU images): no maps.py"),
    f"{XM}.xla_device": (_D, "@deprecated in torch_xla 2.8/2.9", "torch_xla.device()", _XM),
    f"{XM}.mark_step": (_D, "@deprecated in torch_xla 2.8/2.9", "torch_xla.sync()", _XM),
}
_BF16 = (_D, "still obeyed in torch_xla 2.8/2.9, which print 'will be deprecated after the 2.6 "
         "release'", "torch.autocast('xla', dtype=torch.bfloat16)",
         f"torch_xla/csrc/dtype.cpp at {TAGS}")
_FP16 = (_D, "deprecated", "bfloat16 autocast", f"torch_xla/__init__.py at {TAGS}")
ENV = {"XLA_USE_BF16": _BF16, "XLA_DOWNCAST_BF16": _BF16, "XLA_USE_FP16": _FP16,
       "XLA_DOWNCAST_FP16": _FP16}
#: XRT / TPU-Node settings no file of torch_xla 2.8/2.9 reads (Python, csrc, _XLAC.so).
STALE = {"XRT_TPU_CONFIG", "XRT_DEVICE_MAP", "XRT_WORKERS", "XRT_MESH_SERVICE_ADDRESS",
         "XLA_TENSOR_ALLOCATOR_MAXSIZE", "COLAB_TPU_ADDR", "TPU_IP_ADDRESS"}
#: kind -> (severity, what is wrong, the fix, where it was read): static findings' text ({}: what)
RULES = {
    "removed-api": ("error",), "deprecated-api": ("warning",),
    "host-read-in-loop": ("warning", "in the training step: the host waits for the device, every "
                          "step", "keep it on the device; xm.add_step_closure every N steps", ""),
    "no-distributed-sampler": ("error", "a training DataLoader in the replicas without a sampler:"
                               " every replica reads everything", "sampler=DistributedSampler("
                               "ds, num_replicas=xr.world_size(), rank=xr.global_ordinal())", ""),
    "ragged-batches": ("warning", "a training DataLoader without drop_last=True: the smaller last "
                       "batch compiles a second graph", "DataLoader(..., drop_last=True)", ""),
    "launch-nprocs": ("error", "{}", "torch_xla.launch(fn): one process per device (debug_single_"
                      "process=True: one)", f"spawn in _internal/pjrt.py, torch_xla.py at {TAGS}"),
    "wrong-backend": ("error", "backend {}: it does not reduce XLA tensors", "init_process_group("
                      "'xla', init_method='xla://')", f"distributed/xla_backend.py at {TAGS}"),
    "lightning-removed-arg": ("error", "Trainer({}=...): not in Lightning 2.x", "Trainer(accele"
                              "rator='tpu', devices=8)", "Lightning 2.6 CHANGELOG, 2.6.6 itself"),
    "cuda-only": ("error", "a CUDA piece: on a TPU host it fails or trains on the CPU",
                  "torch_xla.device(); torch.autocast('xla', dtype=torch.bfloat16)", ""),
    "torch-checkpoint-on-xla": ("warning", "torch's checkpoint has no optimization barrier: XLA "
                                "merges the recomputation away", "torch_xla.utils.checkpoint."
                                "checkpoint", f"torch_xla/utils/checkpoint.py at {TAGS}"),
    "dynamic-shape": ("warning", "a data-dependent shape in the step: a CPU fallback and a graph "
                      "per count", "a fixed shape: torch.where(mask, x, 0), masked sums", ""),
    "rank-from-env": ("error", "{}: a launch sets no LOCAL_RANK/RANK/WORLD_SIZE (outside torchrun):"
                      " one shard for all, or a KeyError", "rank=xr.global_ordinal(), num_replicas="
                      "xr.world_size()", f"_internal/pjrt.py at {TAGS}: PJRT_LOCAL_PROCESS_RANK"),
    "predicate-not-called": ("error", "{} without (): `== True` is always False, `if f:` always "
                             "true", "call it: xm.is_master_ordinal()", f"xla_model.py at {TAGS}"),
    "stale-env-setting": ("info", "{}: an XRT / TPU-Node setting torch_xla 2.8/2.9 do not read",
                          "remove it (TPU VMs: PJRT_DEVICE=TPU)", f"not in torch_xla at {TAGS}"),
    "stale-install-pin": ("error", "{}: a torch_xla 1.x (XRT) install: env-setup.py is gone, cp36/"
                          "cp37 wheels do not install on Python 3.12/3.13", "keep the image's pair,"
                          " or torch==2.9.0 'torch_xla[tpu]==2.9.0'", "pytorch/xla PR 6692"),
    **{k: ("warning",) for k in ("recompiles", "cpu-fallback", "host-transfers")},
    "crash": ("error",),
}
KINDS = tuple(RULES)
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


_OLD = (r"env-setup\.py|torch_xla-1\.|torch_xla[=<>~]=1\.|torch-1\.\d|torch[=<>~]=1\.|tpu-"
        r"pytorch/wheels|cloud[-_]tpu[-_]client")  # installs of the torch_xla 1.x (XRT) era
_SYSTEM = r"(?:get_ipython\(\)\.(?:system|getoutput)|os\.system)\(\s*[rf]?(['\"])(.*?)\1"


def shell_findings(text: str, shell: dict[int, str], file: str) -> list[Finding]:
    """Shell lines (a notebook's, ``get_ipython().system(...)``, ``os.system(...)``, jupytext's
    ``# !...``): 1.x-era installs, ``xla_spawn.py --num_cores N``, XRT settings (export, %env)."""
    at, strs = lambda m: text.count("\n", 0, m.start()) + 1, dict(re.findall(  # noqa: E731
        r"^(\w+) *= *['\"]([^'\"]*)['\"]", text, re.M))  # expanded in !lines: $NAME, {NAME}
    lines = {**shell, **{at(m): m[2] for m in re.finditer(_SYSTEM, text)}}
    lines |= {at(m): m[1] for m in re.finditer(r"^# ?(?:!|%pip) ?(.*)$", text, re.M)
              } if "\n# %%" in text else {}
    out, rule = [], lambda k, n, w, note=None: Finding(  # noqa: E731
        k, "info" if note else RULES[k][0], file, n, note or RULES[k][1].format(w), *RULES[k][2:])
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
        return "\n".join(rows + self.notes + [
            f"verdict: NOT READY: {e} error(s), {w} warning(s): fix the errors before TPU time"
            if e else f"verdict: runs, but {w} warning(s) will cost TPU time" if w else
            "verdict: clean: nothing found that wastes TPU time"])


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
