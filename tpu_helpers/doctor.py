"""Check a training script before a TPU hour is spent: ``python -m tpu_helpers.doctor SCRIPT``.

Copy it with its sibling ``doctor_run.py`` (the ``--run`` pass); both import only the standard
library (torch/torch_xla only in ``--run``'s child). The static pass reads the source with
:mod:`ast` (imports nothing from it): removed and deprecated APIs, host reads in the training step,
loaders that neither shard nor drop the ragged batch, CUDA-only pieces... ``--run N`` runs the
script on XLA:CPU for N optimizer steps and reads torch_xla's own signals (``doctor_run.py``).
Also ``check()``, ``tpu-doctor`` (``--static FILE...``: pre-commit, CI), ``%tpu_doctor`` in IPython.
A ``.ipynb``: its code cells as one program (no ``%``/``!`` lines); findings name cell and line.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import shlex
import sys
import time
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path

try:  # inside the tpu_helpers package
    from .doctor_run import Finding, dynamic_findings
except ImportError:  # copied next to doctor_run.py into your project (or run as doctor.py)
    from doctor_run import Finding, dynamic_findings  # type: ignore[no-redef]

XM, TAGS = "torch_xla.core.xla_model", "pytorch/xla v2.8.0 and v2.9.0"
_R, _D = "removed-api", "deprecated-api"
_GONE = f"absent from torch_xla/core/xla_model.py at {TAGS}"
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
    f"{XM}.xla_device": (_D, "@deprecated in torch_xla 2.8/2.9", "torch_xla.device()",
                         f"torch_xla/core/xla_model.py at {TAGS}"),
    f"{XM}.mark_step": (_D, "@deprecated in torch_xla 2.8/2.9", "torch_xla.sync()",
                        f"torch_xla/core/xla_model.py at {TAGS}"),
}
_BF16 = (_D, "still obeyed in torch_xla 2.8/2.9, which print 'will be deprecated after the 2.6 "
         "release'", "torch.autocast('xla', dtype=torch.bfloat16)",
         f"torch_xla/csrc/dtype.cpp at {TAGS}")
_FP16 = (_D, "deprecated", "bfloat16 autocast", f"torch_xla/__init__.py at {TAGS}")
ENV = {"XLA_USE_BF16": _BF16, "XLA_DOWNCAST_BF16": _BF16, "XLA_USE_FP16": _FP16,
       "XLA_DOWNCAST_FP16": _FP16}
#: kind -> (severity, what is wrong, the fix, where it was read): the static findings' text.
RULES = {
    "removed-api": ("error",), "deprecated-api": ("warning",),
    "host-read-in-loop": ("warning", "in the training step: the host waits for the device, every "
                          "step", "keep it on the device; xm.add_step_closure every N steps", ""),
    "no-distributed-sampler": ("error", "a training DataLoader in the replicas without a sampler:"
                               " every replica reads everything", "sampler=DistributedSampler("
                               "ds, num_replicas=xr.world_size(), rank=xr.global_ordinal())", ""),
    "ragged-batches": ("warning", "a training DataLoader without drop_last=True: the smaller last "
                       "batch compiles a second graph", "DataLoader(..., drop_last=True)", ""),
    "launch-nprocs": ("error", "{}", "torch_xla.launch(fn): one process per device "
                      "(debug_single_process=True: one)", "spawn in torch_xla/_internal/pjrt.py, "
                      f"launch in torch_xla/torch_xla.py at {TAGS}"),
    "wrong-backend": ("error", "backend {}: it does not reduce XLA tensors", "init_process_group("
                      "'xla', init_method='xla://')", f"distributed/xla_backend.py at {TAGS}"),
    "lightning-removed-arg": ("error", "Trainer(tpu_cores=...) was removed in Lightning 2.0",
                              "Trainer(accelerator='tpu', devices=8)", "Lightning 2.6 CHANGELOG"),
    "cuda-only": ("error", "a CUDA piece: on a TPU host it fails or trains on the CPU",
                  "torch_xla.device(); torch.autocast('xla', dtype=torch.bfloat16)", ""),
    "torch-checkpoint-on-xla": ("warning", "torch's checkpoint has no optimization barrier: XLA "
                                "merges the recomputation away", "torch_xla.utils.checkpoint."
                                "checkpoint", f"torch_xla/utils/checkpoint.py at {TAGS}"),
    "dynamic-shape": ("warning", "a data-dependent shape in the step: a CPU fallback and a graph "
                      "per count", "a fixed shape: torch.where(mask, x, 0), masked sums", ""),
    **{k: ("warning",) for k in ("recompiles", "cpu-fallback", "host-transfers")},
    "crash": ("error",),
}
KINDS = tuple(RULES)
#: Aliases the articles use without importing (a snippet continuing an earlier one).
ALIASES = {"xm": XM, "xmp": "torch_xla.distributed.xla_multiprocessing", "xr": "torch_xla.runtime",
           "pl": "torch_xla.distributed.parallel_loader", "met": "torch_xla.debug.metrics"}
LAUNCHERS = {"torch_xla.launch", f"{ALIASES['xmp']}.spawn", "torch_xla.torch_xla.launch"}
_LOOPS = (ast.For, ast.While, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp)
_READS = {"item", "tolist", "numpy", "cpu"}
_NOT_TENSOR = {"len", "range", "int", "float", "str", "bool", "round", "enumerate", "zip", "dict",
               "list", "tuple", "set", "isinstance", "print", "open", "next", "iter", "time"}


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    run: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return int(any(f.severity == "error" for f in self.findings))

    def to_json(self) -> dict:
        return {"findings": [f.as_json() for f in self.findings], "run": self.run}

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


# --------------------------------------------------------------------------- the static pass
def _dotted(node: ast.AST) -> str | None:
    text = ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""
    return text if re.fullmatch(r"\w+(\.\w+)*", text) else None


class _Static:
    def __init__(self, source: str, file: str):
        self.tree, self.file, self.source = ast.parse(source), file, source
        self.aliases, self.found, self.parents = dict(ALIASES), {}, {}
        for node in ast.walk(self.tree):
            self.parents.update((child, node) for child in ast.iter_child_nodes(node))
        self.funcs = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef)}

    def add(self, node, kind, what="", row=None):
        """One finding per line and kind; its text from ``row`` (API/ENV) or RULES."""
        line, rule = getattr(node, "lineno", 0), RULES[kind]
        msg, fix, src = (f"{what}: {row[1]}", row[2], row[3]) if row else rule[1:]
        msg = msg.format(what) if "{}" in msg else msg if row else f"{what} {msg}".strip()
        self.found.setdefault((line, kind), Finding(kind, rule[0], self.file, line, msg, fix, src))

    def qual(self, node: ast.AST) -> str:
        head, _, rest = (_dotted(node) or "").partition(".")
        return self.aliases.get(head, head) + ("." + rest if rest else "")

    def api(self, node, name: str) -> None:
        for key, row in API.items():
            if name == key or name.startswith(key + "."):
                self.add(node, row[0], key.replace(XM, "xm"), row)

    def names(self) -> None:
        for node in ast.walk(self.tree):  # imports first: they bind the aliases
            for a in node.names if isinstance(node, (ast.Import, ast.ImportFrom)) else []:
                full = f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name
                short = full if a.asname or isinstance(node, ast.ImportFrom) else a.name
                self.aliases[a.asname or a.name.split(".")[0]] = short.split(".")[0] if (
                    short == a.name and not a.asname) else full
                self.api(node, full)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and not isinstance(self.parents.get(node),
                                                                  ast.Attribute):
                self.api(node, self.qual(node))
                if self.qual(node).startswith("torch.cuda.amp"):
                    self.add(node, "cuda-only", "torch.cuda.amp:")
            elif isinstance(node, ast.Constant) and node.value in ENV:
                self.add(node, ENV[node.value][0], node.value, ENV[node.value])
            elif isinstance(node, ast.Call):
                self.call(node, self.qual(node.func))

    def call(self, node: ast.Call, name: str) -> None:
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        const = [a.value for a in (*node.args, *kw.values()) for a in ast.walk(a)
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if name.endswith(".cuda") or any(c == "cuda" or c.startswith("cuda:") for c in const):
            self.add(node, "cuda-only")
        spawn = name in LAUNCHERS and name.endswith("spawn")
        nprocs = kw.get("nprocs", node.args[2] if len(node.args) > 2 and spawn else None)
        if name in LAUNCHERS and nprocs is not None and (not spawn or not (
                isinstance(nprocs, ast.Constant) and nprocs.value in (None, 1))):
            self.add(node, "launch-nprocs", f"{name.split('.')[-1]}(nprocs={ast.unparse(nprocs)}): "
                     + ("ValueError: xmp.spawn takes only None (every device) or 1" if spawn else
                        "torch_xla.launch has no nprocs parameter: TypeError, even for None or 1"))
        backend = kw.get("backend", node.args[0] if node.args else None)
        if name.endswith("init_process_group") and isinstance(backend, ast.Constant) and (
                backend.value == "nccl" or backend.value == "gloo" and re.search(
                    r"torch_xla|jax|TPU|tpu", self.source)):
            self.add(node, "wrong-backend", repr(backend.value))
        if name.endswith("Trainer") and "tpu_cores" in kw:
            self.add(node, "lightning-removed-arg")
        if name in ("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint"):
            self.add(node, "torch-checkpoint-on-xla")

    def chain(self, node, stop=None):
        while (node := self.parents.get(node)) is not None and node is not stop:
            yield node

    def own(self, scope):
        """The nodes of ``scope`` outside nested defs/lambdas (a step closure is fine)."""
        return (n for n in ast.walk(scope) if not any(isinstance(p, (ast.FunctionDef, ast.Lambda))
                                                      for p in [n, *self.chain(n, scope)]
                                                      if p is not scope))

    def is_step(self, node: ast.Call, step_fns: set[str]) -> bool:
        name, f = self.qual(node.func), node.func
        return (name.endswith(("optimizer_step", ".backward")) or name in step_fns
                or isinstance(f, ast.Attribute) and f.attr == "step"
                and re.search(r"opt", _dotted(f.value) or "", re.I) is not None)

    def training_scopes(self) -> list[ast.AST]:
        """Innermost loops that step an optimizer, and step functions (which step unlooped)."""
        self.step_fns: set[str] = set()
        while new := {f.name for f in self.funcs.values() if f.name not in self.step_fns and any(
                isinstance(n, ast.Call) and self.is_step(n, self.step_fns) and not any(
                    isinstance(p, _LOOPS) for p in self.chain(n, f)) for n in self.own(f))}:
            self.step_fns |= new  # functions that step, and functions calling them once
        loops = [n for n in ast.walk(self.tree) if isinstance(n, (ast.For, ast.While)) and any(
            isinstance(c, ast.Call) and self.is_step(c, self.step_fns) for c in self.own(n))]
        inner = [lp for lp in loops if not any(o is not lp and lp in self.chain(o) for o in loops)]
        self.iterated = {n.id for s in inner if isinstance(s, ast.For) for n in ast.walk(s.iter)
                         if isinstance(n, ast.Name)}
        return inner + [self.funcs[s] for s in self.step_fns]

    def tensors(self, scope) -> set[str]:
        """Names that hold XLA tensors there (by how they were made: a good guess, not a proof)."""
        names = {"loss", "output", "outputs", "logits", "pred", "preds"}
        if isinstance(scope, ast.For) and re.search(  # a DataLoader's batches are CPU tensors
                r"DeviceLoader|ParallelLoader|per_device|para_loader", ast.unparse(scope.iter)):
            targets = scope.target.elts if isinstance(scope.target, ast.Tuple) else [scope.target]
            enum = isinstance(scope.iter, ast.Call) and _dotted(scope.iter.func) == "enumerate"
            names |= {n.id for t in targets[enum:] for n in ast.walk(t) if isinstance(n, ast.Name)}
        fn = next((p for p in self.chain(scope) if isinstance(p, ast.FunctionDef)), self.tree)
        for n in (n for n in ast.walk(fn) if isinstance(n, ast.Assign)):
            pairs = [(t, n.value) for t in n.targets]
            if isinstance(n.value, ast.Tuple) and isinstance(n.targets[0], ast.Tuple):
                pairs = list(zip(n.targets[0].elts, n.value.elts, strict=False))
            for t, v in pairs:
                head = _dotted(v.func if isinstance(v, ast.Call) else getattr(v, "left", v)) or ""
                if isinstance(t, ast.Name) and isinstance(v, (ast.Call, ast.BinOp)) and (
                        head.split(".")[0] not in _NOT_TENSOR and not head.endswith(tuple(_READS))
                        and (head.split(".")[0] in ("torch", "F", *names) or head.endswith(".to")
                             or re.search(r"loss|model|criterion|net|step", head, re.I))):
                    names.add(t.id)
        return names

    def host_reads(self, scope) -> None:
        tensors = self.tensors(scope)
        uses = lambda e: any(isinstance(n, ast.Name) and n.id in tensors for n in ast.walk(e))
        for n in self.own(scope):
            call = (_dotted(n.func) or "") if isinstance(n, ast.Call) else ""
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                    n.func.attr in _READS and not n.args or n.func.attr == "to" and any(
                        isinstance(a, ast.Constant) and a.value == "cpu" for a in n.args)):
                self.add(n, "host-read-in-loop", f".{n.func.attr}()")
            elif call in ("float", "int", "bool") and n.args and uses(n.args[0]):
                self.add(n, "host-read-in-loop", f"{call}(tensor)")
            elif call.endswith("print") and any(isinstance(a, ast.Name) and a.id in tensors
                                                for a in n.args):
                self.add(n, "host-read-in-loop", "print(tensor)")
            elif isinstance(n, ast.FormattedValue) and (
                    isinstance(n.value, ast.Name) and n.value.id in tensors or isinstance(
                        n.value, ast.Call) and _dotted(n.value.func) in self.step_fns):
                self.add(n, "host-read-in-loop", "f'{tensor}'")
            elif isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert)) and n is not scope \
                    and uses(n.test):
                self.add(n, "host-read-in-loop", "if tensor")

    def dynamic_shapes(self, scope) -> None:
        masks = {t.id for n in self.own(scope) if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Compare) for t in n.targets if isinstance(t, ast.Name)}
        for n in self.own(scope):
            name = self.qual(n.func) if isinstance(n, ast.Call) else ""
            if isinstance(n, ast.Subscript) and (isinstance(n.slice, ast.Compare) or isinstance(
                    n.slice, ast.Name) and n.slice.id in masks) or name.endswith(
                    (".nonzero", "masked_select", "torch.unique")) or (
                    name == "torch.where" and len(n.args) == 1):
                self.add(n, "dynamic-shape")

    def loaders(self) -> None:
        launched = {a.id for n in ast.walk(self.tree) if isinstance(n, ast.Call) and self.qual(
            n.func) in LAUNCHERS for a in n.args[:1] if isinstance(a, ast.Name)}
        launched |= {c.func.id for f in launched & set(self.funcs) for c in ast.walk(
            self.funcs[f]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        for n in ast.walk(self.tree):
            if not (isinstance(n, ast.Call) and self.qual(n.func).endswith("DataLoader")):
                continue
            kw = {k.arg: k.value for k in n.keywords}
            fn = next((p.name for p in self.chain(n) if isinstance(p, ast.FunctionDef)), "")
            sampler = kw.get("sampler", kw.get("batch_sampler", n.args[3] if len(n.args) > 3
                                               else None))
            train = any(isinstance(t, ast.Name) and ("train" in t.id or t.id in self.iterated)
                        for t in getattr(self.parents.get(n), "targets", [])) or any(
                k == "shuffle" and isinstance(v, ast.Constant) and v.value is True
                for k, v in kw.items())
            if (fn in launched and train or "init_process_group" in self.source) and (
                    sampler is None or isinstance(sampler, ast.Constant) and sampler.value is None):
                self.add(n, "no-distributed-sampler")
            drop = kw.get("drop_last")
            if (train or "DistributedSampler" in ast.unparse(sampler or n)) and not kw.get(
                    "batch_sampler") and (drop is None or isinstance(drop, ast.Constant)
                                          and not drop.value):
                self.add(n, "ragged-batches")

    def run(self) -> list[Finding]:
        self.names()
        for scope in self.training_scopes():
            self.host_reads(scope)
            self.dynamic_shapes(scope)
        self.loaders()
        return sorted(self.found.values(), key=lambda f: (f.line, f.kind))


def static_findings(source: str, file: str = "<script>") -> list[Finding]:
    """The static pass over ``source`` (never imported or run)."""
    try:
        return _Static(source, file).run()
    except SyntaxError as exc:
        return [Finding("crash", "error", file, exc.lineno or 0, f"SyntaxError: {exc.msg}", "")]


# --------------------------------------------------------------------------- reading files
class Unreadable(ValueError):
    """Neither Python nor a notebook (or no such file): the command line exits 2 with the reason."""


_IPYTHON = re.compile(r"(\s*)((\w+\s*=\s*)?[%!].*|\??[\w.]+\?\??|\?\??[\w.]+)\s*")  # %, !, x?
_PY_BODY = {"time", "timeit", "capture", "prun"}  # %%magics whose body is Python run in the kernel


def read_source(path: str) -> tuple[str, list[tuple[int, int, int]] | None]:
    """A script's text; or a notebook's code cells as one program (IPython-only lines as ``pass`` or
    blank, so lines stay) and, per line, (code cell number, cell index, line in the cell)."""
    try:
        data = Path(path).read_bytes()
        if b"\0" in data:
            raise Unreadable("a binary file (NUL bytes), neither Python nor a notebook")
        text = data.decode(tokenize.detect_encoding(io.BytesIO(data).readline)[0])
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:  # OSError: missing, a directory...
        raise Unreadable(getattr(exc, "strerror", 0) or f"not UTF-8 (or its coding line's): {exc}"
                         ) from None
    if not path.endswith(".ipynb"):
        return text, None
    try:
        cells = [(i, "".join(c["source"])) for i, c in enumerate(json.loads(text)["cells"])
                 if c["cell_type"] == "code"]  # a source is a string or a list of strings
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON's errors: ValueError
        raise Unreadable(f"not a notebook (JSON, a cells list): {type(exc).__name__}: {exc}"
                         ) from None
    lines, where = [], []
    for number, (index, source) in enumerate(cells, 1):
        body = re.split(r"\r\n?|\n", source)
        magic = re.match(r"%%(\w+)", body[0])
        for n, line in enumerate(body, 1):
            shell = _IPYTHON.fullmatch(line)
            lines.append("" if magic and (n == 1 or magic[1] not in _PY_BODY) else
                         shell[1] + "pass" if shell else line)
            where.append((number, index, n))
    return "\n".join(lines), where


def this_notebook() -> str:
    """The notebook this kernel runs, as VS Code (``__vsc_ipynb_file__``) or Jupyter
    (``__session__``, ``JPY_SESSION_NAME``) name it; :class:`Unreadable` when nothing does."""
    ip = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    ns, env = getattr(ip, "user_ns", {}), os.getenv("JPY_SESSION_NAME")
    for name in map(str, filter(None, (ns.get("__vsc_ipynb_file__"), ns.get("__session__"), env))):
        for path in (Path(name), Path(Path(name).name)):  # as named, or in the cwd
            if path.suffix == ".ipynb" and path.is_file():
                return str(path)
    raise Unreadable("nothing names this notebook here (__vsc_ipynb_file__, __session__, "
                     "JPY_SESSION_NAME): save it and pass its path: %tpu_doctor NOTEBOOK.ipynb")


# --------------------------------------------------------------------------- entry points
def check(script: str, args=(), run: int | None = None, timeout: float = 300) -> Report:
    """Both passes over ``script``, a ``.py`` file or a notebook (the dynamic one when ``run`` is a
    number of steps: scripts only); :class:`Unreadable` if it is neither."""
    source, where = read_source(script)
    if run and where is not None:
        raise Unreadable("--run runs scripts: export the notebook first (jupyter nbconvert --to "
                         "script), or run the static pass")
    report = Report(static_findings(source, script))
    if where is not None:
        at = lambda line: where[min(max(line, 1), len(where)) - 1]
        report.findings = [replace(f, cell=c, cell_index=i, line=n)
                           for f in report.findings for c, i, n in [at(f.line)]]
    if run:
        found, report.run, report.notes = dynamic_findings(script, args, run, timeout)
        report.findings += found
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpu-doctor", description=__doc__.split("\n")[0])
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


def load_ipython_extension(ipython) -> None:
    """``%tpu_doctor [--run N] SCRIPT [ARGS]`` in IPython/Jupyter (``%load_ext`` or import);
    ``%tpu_doctor`` alone checks the notebook it runs in (its saved file)."""
    ipython.register_magic_function(lambda line: main(shlex.split(line)) and None, "line",
                                    "tpu_doctor")


if "IPython" in sys.modules:  # imported in a notebook: register %tpu_doctor
    _ip = sys.modules["IPython"].get_ipython()
    if _ip is not None:
        load_ipython_extension(_ip)

if __name__ == "__main__":
    sys.exit(main())
