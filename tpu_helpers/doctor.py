"""Check a training script before a TPU hour is spent: ``python -m tpu_helpers.doctor SCRIPT``.

Copy this file alone (stdlib at import; torch/torch_xla only in ``--run``'s child). Two passes:
the static pass reads the source with :mod:`ast` (it imports nothing from it) and names removed
and deprecated torch_xla APIs, host reads in the training loop, loaders that neither shard nor
drop the ragged batch, CUDA-only pieces and more; ``--run N`` runs the script on XLA:CPU for N
optimizer steps and reads torch_xla's own signals (``torch_xla.debug.metrics``, the
``PT_XLA_DEBUG_LEVEL=2`` analysis, the CPU-fallback tracker). Also ``check()`` and, in IPython,
``%tpu_doctor SCRIPT``. Exit status 1 when any finding is an error.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

XM, XMP = "torch_xla.core.xla_model", "torch_xla.distributed.xla_multiprocessing"
_XLA_SRC = "pytorch/xla v2.8.0 and v2.9.0"
#: qualified name -> (kind, what changed, the fix, where it was read). Checked at the tags.
API = {
    f"{XM}.xrt_world_size": ("removed-api", "removed in torch_xla 2.7 (deprecated in 2.6)",
                             "torch_xla.runtime.world_size()",
                             f"absent from torch_xla/core/xla_model.py at {_XLA_SRC}"),
    f"{XM}.get_ordinal": ("removed-api", "removed in torch_xla 2.7 (deprecated in 2.6)",
                          "torch_xla.runtime.global_ordinal()",
                          f"absent from torch_xla/core/xla_model.py at {_XLA_SRC}"),
    f"{XM}.parse_xla_device": ("removed-api", "removed in torch_xla 2.7", "torch.device(s).index",
                               f"absent from torch_xla/core/xla_model.py at {_XLA_SRC}"),
    "torch_xla.distributed.xla_dist": (
        "removed-api", "removed in torch_xla 2.1 (last in 2.0)",
        "torch_xla.launch(fn) on each host (gcloud ... ssh --worker=all)",
        f"torch_xla/distributed/xla_dist.py: in v2.0.0, absent at {_XLA_SRC}"),
    "torch_xla.experimental.pjrt": ("removed-api", "not in torch_xla 2.8/2.9",
                                    "torch_xla.runtime (import torch_xla.runtime as xr)",
                                    f"no torch_xla/experimental/pjrt.py at {_XLA_SRC}"),
    "torch_xla.experimental.xla_sharding": (
        "removed-api", "not in torch_xla 2.8/2.9", "import torch_xla.distributed.spmd as xs",
        f"no torch_xla/experimental/xla_sharding.py at {_XLA_SRC}"),
    "torch_xla.amp.GradScaler": (
        "removed-api", "removed in torch_xla 2.9 (still in 2.8)",
        "bfloat16 needs no loss scaling: torch.autocast('xla', dtype=torch.bfloat16), no scaler",
        "torch_xla/amp/__init__.py at pytorch/xla v2.8.0 vs v2.9.0"),
    "jax.experimental.maps": ("removed-api", "removed from JAX; torch_xla never used it",
                              "torch_xla.launch (data parallel) or SPMD (torch_xla.distributed.spmd)",
                              "jax 0.7.2 (Colab's and Kaggle's TPU images): no "
                              "jax/experimental/maps.py"),
    f"{XM}.xla_device": ("deprecated-api", "@deprecated in torch_xla 2.8 and 2.9",
                         "torch_xla.device()", f"torch_xla/core/xla_model.py at {_XLA_SRC}"),
    f"{XM}.mark_step": ("deprecated-api", "@deprecated in torch_xla 2.8 and 2.9", "torch_xla.sync()",
                        f"torch_xla/core/xla_model.py at {_XLA_SRC}"),
}
_BF16 = ("deprecated-api", "deprecated since torch_xla 2.6 (a notice at start-up)",
         "torch.autocast('xla', dtype=torch.bfloat16) or model.to(torch.bfloat16)",
         f"torch_xla/csrc/dtype.cpp at {_XLA_SRC}")
_FP16 = ("deprecated-api", "deprecated (a warning at import)", "drop it; use bfloat16 autocast",
         f"_check_deprecated_env_var, torch_xla/__init__.py at {_XLA_SRC}")
ENV = {"XLA_USE_BF16": _BF16, "XLA_DOWNCAST_BF16": _BF16, "XLA_USE_FP16": _FP16,
       "XLA_DOWNCAST_FP16": _FP16}
#: Aliases the articles use without importing (a snippet continuing an earlier one).
DEFAULT_ALIASES = {"xm": XM, "xmp": XMP, "xr": "torch_xla.runtime", "met": "torch_xla.debug.metrics",
                   "pl": "torch_xla.distributed.parallel_loader"}
LAUNCHERS = {"torch_xla.launch", f"{XMP}.spawn", "torch_xla.torch_xla.launch"}
_LOOPS = (ast.For, ast.While, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp)
_READS = {"item", "tolist", "numpy", "cpu"}
_NOT_TENSOR = {"len", "range", "int", "float", "str", "bool", "round", "enumerate", "zip", "dict",
               "list", "tuple", "set", "isinstance", "print", "open", "next", "iter", "time"}
KINDS = ("removed-api", "deprecated-api", "host-read-in-loop", "no-distributed-sampler",
         "ragged-batches", "launch-nprocs", "wrong-backend", "lightning-removed-arg", "cuda-only",
         "torch-checkpoint-on-xla", "dynamic-shape", "recompiles", "cpu-fallback",
         "host-transfers", "crash")


@dataclass
class Finding:
    kind: str
    severity: str  # "error" | "warning" | "info"
    file: str
    line: int
    message: str
    fix: str
    source: str = ""  # where the rule was read (the human table only)

    def as_json(self) -> dict:
        return {k: getattr(self, k) for k in ("kind", "severity", "file", "line", "message", "fix")}


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

    def verdict(self) -> str:
        n = {s: sum(f.severity == s for f in self.findings) for s in ("error", "warning", "info")}
        if n["error"]:
            return (f"verdict: NOT READY: {n['error']} error(s), {n['warning']} warning(s): fix the "
                    "errors before spending TPU time")
        if n["warning"]:
            return f"verdict: runs, but {n['warning']} warning(s) will cost TPU time"
        return "verdict: clean: nothing found that wastes TPU time"

    def table(self) -> str:
        rows = [f"{'line':>5}  {'severity':8} {'kind':23} finding"]
        for f in sorted(self.findings, key=lambda f: (f.line, f.kind)):
            rows.append(f"{f.line:>5}  {f.severity:8} {f.kind:23} {f.message}")
            rows += [f"{'':39}fix: {f.fix}"] + ([f"{'':39}source: {f.source}"] if f.source else [])
        if self.run is not None:
            r = self.run
            rows.append(f"run: {r['steps']} steps, {r['compiles_after_warmup']} compiles after "
                        f"warm-up, {r['transfers_per_step']} device-to-host transfers/step, "
                        f"fallback ops {r['fallback_ops'] or 'none'}")
        return "\n".join(rows + self.notes + [self.verdict()])


# --------------------------------------------------------------------------- the static pass

def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


class _Static:
    def __init__(self, source: str, file: str):
        self.tree, self.file, self.source = ast.parse(source), file, source
        self.aliases = dict(DEFAULT_ALIASES)
        self.found: dict[tuple[int, str], Finding] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.funcs = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef)}

    def add(self, node, kind, severity, message, fix, source=""):
        key = (getattr(node, "lineno", 0), kind)
        self.found.setdefault(key, Finding(kind, severity, self.file, key[0], message, fix, source))

    def qual(self, node: ast.AST) -> str:
        name = _dotted(node) or ""
        head, _, rest = name.partition(".")
        target = self.aliases.get(head)
        return (target + ("." + rest if rest else "")) if target else name

    def api(self, node, name: str) -> None:
        for key, (kind, what, fix, source) in API.items():
            if name == key or name.startswith(key + "."):
                self.add(node, kind, "error" if kind == "removed-api" else "warning",
                         f"{key.rsplit('.', 1)[-1] if 'core' in key else key}: {what}", fix, source)

    def imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                        a.name.split(".")[0]
                    self.api(node, a.name)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    self.api(node, f"{node.module}.{a.name}")

    def calls_and_names(self) -> None:
        xla = bool(re.search(r"torch_xla|jax|TPU|tpu", self.source))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and not isinstance(self.parents.get(node),
                                                                  ast.Attribute):
                self.api(node, self.qual(node))
                if self.qual(node).startswith("torch.cuda.amp"):
                    self.add(node, "cuda-only", "error", "torch.cuda.amp is for CUDA devices",
                             "torch.autocast('xla', dtype=torch.bfloat16); no GradScaler")
            elif isinstance(node, ast.Constant) and node.value in ENV:
                kind, what, fix, source = ENV[node.value]
                self.add(node, kind, "warning", f"{node.value}: {what}", fix, source)
            elif isinstance(node, ast.Call):
                self.call(node, self.qual(node.func), xla)

    def call(self, node: ast.Call, name: str, xla: bool) -> None:
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        const = [a.value for a in (*node.args, *kw.values()) for a in ast.walk(a)
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if name.endswith(".cuda") or any(c == "cuda" or c.startswith("cuda:") for c in const):
            self.add(node, "cuda-only", "error", "a CUDA device: on a TPU machine this fails or "
                     "silently trains on the host CPU", "device = torch_xla.device(); .to(device)")
        if name in LAUNCHERS:
            nprocs = kw.get("nprocs", node.args[2] if len(node.args) > 2 and "spawn" in name
                            else None)
            if nprocs is not None and not (isinstance(nprocs, ast.Constant)
                                           and nprocs.value in (None, 1)):
                self.add(node, "launch-nprocs", "error", f"{name.split('.')[-1]}(nprocs=...): "
                         "only None (all devices) or 1 is accepted (ValueError/TypeError)",
                         "drop nprocs: one process per device is the default",
                         f"spawn in torch_xla/_internal/pjrt.py, launch in torch_xla/torch_xla.py "
                         f"at {_XLA_SRC}")
        if name.endswith("init_process_group"):
            backend = kw.get("backend", node.args[0] if node.args else None)
            if isinstance(backend, ast.Constant) and backend.value in ("nccl", "gloo") and (
                    xla or backend.value == "nccl"):
                self.add(node, "wrong-backend", "error", f"backend '{backend.value}' does not "
                         "reduce XLA tensors (nccl is CUDA only)",
                         "dist.init_process_group('xla', init_method='xla://')",
                         f"torch_xla/distributed/xla_backend.py at {_XLA_SRC}")
        if name.endswith("Trainer") and "tpu_cores" in kw:
            self.add(node, "lightning-removed-arg", "error", "Trainer(tpu_cores=...) was removed "
                     "in Lightning 2.0 (TypeError)", "Trainer(accelerator='tpu', devices=8)",
                     "lightning 2.6 CHANGELOG.md: 'Removed the Trainer(tpu_cores=...) argument'")
        if name in ("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint"):
            self.add(node, "torch-checkpoint-on-xla", "warning", "torch's checkpoint lets XLA "
                     "merge the recomputation away (no optimization barrier): no memory saved",
                     "torch_xla.utils.checkpoint.checkpoint",
                     f"torch_xla/utils/checkpoint.py (its header) at {_XLA_SRC}")

    # ------------------------------------------------------------------- loops and loaders

    def in_closure(self, node, stop) -> bool:
        """Inside a def/lambda nested in ``stop`` (a step closure is fine)."""
        while node is not stop and node is not None:
            if isinstance(node, (ast.FunctionDef, ast.Lambda, ast.AsyncFunctionDef)):
                return True
            node = self.parents.get(node)
        return False

    def own(self, scope):
        return (n for n in ast.walk(scope) if not self.in_closure(n, scope))

    def is_step(self, node: ast.Call, step_fns: set[str]) -> bool:
        name, f = self.qual(node.func), node.func
        return (name.endswith(("optimizer_step", ".backward")) or name in step_fns
                or isinstance(f, ast.Attribute) and f.attr == "step"
                and re.search(r"opt", _dotted(f.value) or "", re.I) is not None)

    def training_scopes(self) -> list[ast.AST]:
        """Innermost loops that step an optimizer, and step functions (which do it unlooped)."""
        step_fns: set[str] = set()
        while new := {f.name for f in self.funcs.values() if f.name not in step_fns and any(
                isinstance(n, ast.Call) and self.is_step(n, step_fns) and not any(
                    isinstance(p, _LOOPS) for p in self.chain(n, f)) for n in self.own(f))}:
            step_fns |= new  # functions that step, and functions calling them once
        loops = [n for n in ast.walk(self.tree) if isinstance(n, (ast.For, ast.While)) and any(
            isinstance(c, ast.Call) and self.is_step(c, step_fns) for c in self.own(n))]
        inner = [lp for lp in loops if not any(o is not lp and o in set(ast.walk(lp)) for o in loops)]
        self.step_fns = step_fns
        return inner + [self.funcs[s] for s in step_fns]

    def chain(self, node, stop):
        while (node := self.parents.get(node)) is not None and node is not stop:
            yield node

    def tensors(self, scope) -> set[str]:
        names = {"loss", "output", "outputs", "logits", "pred", "preds"}
        fn = next((p for p in self.chain(scope, None) if isinstance(p, ast.FunctionDef)), self.tree)
        on_device = isinstance(scope, ast.For) and re.search(
            r"DeviceLoader|ParallelLoader|per_device_loader|para_loader", ast.unparse(scope.iter))
        if on_device:  # batches from a device loader are XLA tensors; a DataLoader's are not
            targets = scope.target.elts if isinstance(scope.target, ast.Tuple) else [scope.target]
            enum = isinstance(scope.iter, ast.Call) and _dotted(scope.iter.func) == "enumerate"
            names |= {n.id for t in targets[int(enum):] for n in ast.walk(t)
                      if isinstance(n, ast.Name)}
        for n in ast.walk(fn):
            if not isinstance(n, ast.Assign):
                continue
            pairs = [(t, n.value) for t in n.targets]
            if isinstance(n.value, ast.Tuple) and isinstance(n.targets[0], ast.Tuple):
                pairs = list(zip(n.targets[0].elts, n.value.elts))
            for t, v in pairs:
                head = _dotted(v.func if isinstance(v, ast.Call) else getattr(v, "left", v)) or ""
                root = head.split(".")[0]
                if isinstance(t, ast.Name) and isinstance(v, (ast.Call, ast.BinOp)) and (
                        root not in _NOT_TENSOR and not head.endswith(tuple(_READS))) and (
                        root in ("torch", "F", "model") or root in names or head.endswith(".to")
                        or re.search(r"loss|model|criterion|net|step", head, re.I)):
                    names.add(t.id)
        return names

    def host_reads(self, scope) -> None:
        tensors = self.tensors(scope)
        uses = lambda e: any(isinstance(n, ast.Name) and n.id in tensors for n in ast.walk(e))
        fix = ("keep values on the device; read them in xm.add_step_closure(fn, args=(loss,)) "
               "every N steps, or once after the loop")
        for n in self.own(scope):
            what = None
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                    n.func.attr in _READS and not n.args or n.func.attr == "to" and any(
                        isinstance(a, ast.Constant) and a.value == "cpu" for a in n.args)):
                what = f".{n.func.attr}()"
            elif isinstance(n, ast.Call) and _dotted(n.func) in ("float", "int", "bool") and (
                    n.args and uses(n.args[0])):
                what = f"{_dotted(n.func)}(tensor)"
            elif isinstance(n, ast.Call) and (_dotted(n.func) or "").endswith("print") and any(
                    isinstance(a, ast.Name) and a.id in tensors for a in n.args) or isinstance(
                    n, ast.FormattedValue) and (isinstance(n.value, ast.Name) and n.value.id in
                                                tensors or _dotted(n.value.func if isinstance(
                                                    n.value, ast.Call) else n) in self.step_fns):
                what = "print(tensor)" if isinstance(n, ast.Call) else "f'{tensor}'"
            elif isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert)) and n is not scope \
                    and uses(n.test):
                what = "if tensor"
            if what:
                self.add(n, "host-read-in-loop", "warning", f"{what} in the training step: the "
                         "host waits for the device and the graph is cut, every step", fix)

    def dynamic_shapes(self, scope) -> None:
        masks = {t.id for n in self.own(scope) if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Compare) for t in n.targets if isinstance(t, ast.Name)}
        for n in self.own(scope):
            name = self.qual(n.func) if isinstance(n, ast.Call) else ""
            masked = isinstance(n, ast.Subscript) and (isinstance(n.slice, ast.Compare) or (
                isinstance(n.slice, ast.Name) and n.slice.id in masks))
            if masked or name.endswith((".nonzero", "masked_select", "torch.unique")) or (
                    name == "torch.where" and len(n.args) == 1):
                self.add(n, "dynamic-shape", "warning", "a data-dependent shape in the step "
                         "(boolean mask / nonzero): a CPU fallback and a new graph per count",
                         "keep the shape: torch.where(mask, x, 0) and sums over the mask")

    def loaders(self) -> None:
        launched = {a.id for n in ast.walk(self.tree) if isinstance(n, ast.Call)
                    and self.qual(n.func) in LAUNCHERS for a in n.args[:1] if isinstance(a, ast.Name)}
        launched |= {c.func.id for f in launched if f in self.funcs for c in ast.walk(self.funcs[f])
                     if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        replicas = "init_process_group" in self.source
        for n in ast.walk(self.tree):
            if not (isinstance(n, ast.Call) and self.qual(n.func).endswith("DataLoader")):
                continue
            kw = {k.arg: k.value for k in n.keywords}
            fn = next((p.name for p in self.chain(n, None) if isinstance(p, ast.FunctionDef)), "")
            sampler = kw.get("sampler", kw.get("batch_sampler", n.args[3] if len(n.args) > 3 else
                                               None))
            target = self.parents.get(n)
            train = any(isinstance(t, ast.Name) and ("train" in t.id or t.id in self.iterated)
                        for t in getattr(target, "targets", [])) or any(
                isinstance(v, ast.Constant) and v.value is True for k, v in kw.items()
                if k == "shuffle")
            if (fn in launched and train or replicas) and (sampler is None or isinstance(
                    sampler, ast.Constant) and sampler.value is None):
                self.add(n, "no-distributed-sampler", "error", "a DataLoader in the replicas "
                         "without a sampler: every replica reads the whole dataset",
                         "sampler=DistributedSampler(ds, num_replicas=xr.world_size(), "
                         "rank=xr.global_ordinal(), shuffle=True)")
            drop = kw.get("drop_last")
            if (train or "DistributedSampler" in ast.unparse(sampler or n)) and not kw.get(
                    "batch_sampler") and (
                    drop is None or isinstance(drop, ast.Constant) and not drop.value):
                self.add(n, "ragged-batches", "warning", "a training DataLoader without "
                         "drop_last=True: the last, smaller batch compiles a second graph",
                         "DataLoader(..., drop_last=True)")

    def run(self) -> list[Finding]:
        self.imports()
        self.calls_and_names()
        scopes = self.training_scopes()
        self.iterated = {n.id for s in scopes if isinstance(s, ast.For) for n in ast.walk(s.iter)
                         if isinstance(n, ast.Name)}
        for scope in scopes:
            self.host_reads(scope)
            self.dynamic_shapes(scope)
        self.loaders()
        return sorted(self.found.values(), key=lambda f: (f.line, f.kind))


def static_findings(source: str, file: str = "<script>") -> list[Finding]:
    """The static pass over ``source`` (never imported or run)."""
    try:
        return _Static(source, file).run()
    except SyntaxError as exc:
        return [Finding("crash", "error", file, exc.lineno or 0, f"SyntaxError: {exc.msg}",
                        "fix the syntax")]


# --------------------------------------------------------------------------- the dynamic pass

_FRAME = re.compile(r"^\s+(\S+) \((.+):(\d+)\)\s*$")
_SITECUSTOMIZE = """import importlib.util, os, sys
_s = importlib.util.spec_from_file_location("_tpu_doctor_probe", os.environ["TPU_DOCTOR_FILE"])
_m = sys.modules["_tpu_doctor_probe"] = importlib.util.module_from_spec(_s)
_s.loader.exec_module(_m); _m._probe()
"""


def _probe() -> None:
    """Runs in the child (from its sitecustomize): a snapshot of torch_xla's counters at each
    optimizer step; after N steps it stops the whole process group."""
    try:
        import atexit

        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:
        return
    out = Path(os.environ["TPU_DOCTOR_OUT"]) / f"{os.getpid()}.jsonl"
    limit, state = int(os.environ["TPU_DOCTOR_STEPS"]), {"steps": 0}

    def snap(event: str) -> None:
        rec = {"event": event, "step": state["steps"]}
        for key in ("PT_XLA_DEBUG_FILE", "XLA_FNTRACKER_FILE"):
            rec[key] = os.path.getsize(os.environ[key]) if os.path.exists(os.environ[key]) else 0
        if "torch_xla" in sys.modules:
            import torch_xla.debug.metrics as met
            count = lambda m: int((met.metric_data(m) or (0,))[0])
            rec.update(compiles=count("CompileTime"), transfers=count("TransferFromDeviceTime"),
                       executions=count("ExecuteTime") + count("ExecuteReplicatedTime"),
                       fallbacks={n: int(met.counter_value(n)) for n in met.counter_names()
                                  if n.startswith("aten::") and n != "aten::_local_scalar_dense"})
        with open(out, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def hook(optimizer, args, kwargs) -> None:
        state["steps"] += 1
        if state["steps"] == 1:
            atexit.register(snap, "exit")  # after torch_xla's own: it runs first
        if state["steps"] > limit:
            if "torch_xla" in sys.modules:
                import torch_xla.core.xla_model as xm
                xm.wait_device_ops()
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
            cur = {"kind": m.group(1), "cause": [], "hash": "", "inputs": -1, "frames": []}
            blocks.append(cur)
        elif m and cur is not None and m.group(1) == cur["kind"]:
            if (h := re.search(r"Graph Hash: (\w+)", body)):
                cur["hash"] = h.group(1)
            elif (i := re.search(r"Number of Graph Inputs: (\d+)", body)):
                cur["inputs"] = int(i.group(1))
            elif (f := _FRAME.match(body)):
                cur["frames"].append((f.group(2), int(f.group(3))))
            elif not cur["hash"] and body.startswith("  ") and not cur["frames"]:
                cur["cause"].append(body.strip())
    return blocks


def _tracked(text: str) -> list[tuple[str, tuple[str, int] | None]]:
    """The fallback tracker's ``[TAG xla_fallback ...]`` entries: (aten op, first Python frame)."""
    out = []
    for chunk in text.split("[TAG ")[1:]:
        py, _, cpp = chunk.partition("C++ Frames")
        op = re.search(r"at::_ops::(\w+)::", cpp)
        frames = [(m.group(2), int(m.group(3))) for m in map(_FRAME.match, py.splitlines()) if m]
        out.append((op.group(1) if op else "?", _user(frames)))
    return out


def _user(frames: list[tuple[str, int]]) -> tuple[str, int] | None:
    lib = ("site-packages", "dist-packages", "<frozen", sys.prefix + "/lib", sys.base_prefix + "/lib")
    return next((f for f in frames if not any(s in f[0] for s in lib)), None)


def _read(path: str, start: int, end: int | None = None) -> str:
    with open(path, errors="replace") as fh:
        fh.seek(start)
        return fh.read() if end is None else fh.read(max(end - start, 0))


def _crash(stderr: str, file: str) -> Finding:
    frames = [(m.group(1), int(m.group(2))) for m in
              re.finditer(r'File "([^"]+)", line (\d+)', stderr)]
    here = [f for f in frames if os.path.abspath(f[0]) == os.path.abspath(file)] or \
        [f for f in frames if _user([f])]
    errors = re.findall(r"^((?:\w+\.)*\w*(?:Error|Exception|Exit)\b.*)$", stderr, re.M)
    line = here[-1][1] if here else 0
    return Finding("crash", "error", file, line, f"the script crashed: "
                   f"{errors[-1] if errors else stderr.strip()[-300:]}",
                   "fix this line first (a removed API, a bad launch, a shape error...)")


def dynamic_findings(script: str, args=(), steps: int = 10, timeout: float = 300,
                     warmup: int = 2) -> tuple[list[Finding], dict, list[str]]:
    """Run ``script`` on XLA:CPU for ``steps`` optimizer steps; what torch_xla reported."""
    tmp = Path(tempfile.mkdtemp(prefix="tpu_doctor_"))
    (tmp / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    dbg, fnt = str(tmp / "analysis.txt"), str(tmp / "fallbacks.txt")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PT_XLA_DEBUG": "1", "PT_XLA_DEBUG_LEVEL": "2",
           "PT_XLA_DEBUG_FILE": dbg, "XLA_FNTRACKER_FILE": fnt,
           "XLA_FNTRACKER_LIST": "xla_fallback", "TPU_DOCTOR_FILE": os.path.abspath(__file__),
           "TPU_DOCTOR_OUT": str(tmp), "TPU_DOCTOR_STEPS": str(steps),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, script, *args], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    notes = []
    try:
        _, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        _, stderr = child.communicate()
        notes.append(f"note: stopped at the {timeout:.0f} s time limit")
    runs = [[json.loads(x) for x in p.read_text().splitlines()] for p in tmp.glob("*.jsonl")]
    recs = max(runs, key=lambda r: (max(x["step"] for x in r), len(r)), default=[])
    stopped = any(r["event"] == "stop" for r in recs)
    findings = [] if stopped or child.returncode in (0, None) else [_crash(stderr, script)]
    return findings + _analyse(recs, warmup, script, dbg, fnt, notes), _summary(recs, warmup), notes


def _window(recs: list[dict], warmup: int) -> tuple[dict, dict, int]:
    """The records bounding the measured steps (after warm-up) and how many steps they hold."""
    done = lambda r: r["step"] - (r["event"] == "step")  # steps finished when it was taken
    end = next((r for r in recs if r["event"] in ("stop", "exit")), recs[-1] if recs else {})
    w = min(warmup, max(done(end) - 1, 0)) if end else 0
    base = next((r for r in recs if r["event"] == "step" and done(r) >= w), end)
    return base, end, max(done(end) - done(base), 1) if end else 1


def _summary(recs: list[dict], warmup: int) -> dict:
    base, end, n = _window(recs, warmup)
    get = lambda r, k: r.get(k, 0)
    return {"steps": end.get("step", 0), "compiles_after_warmup": get(end, "compiles") - get(
        base, "compiles"), "transfers_per_step": round((get(end, "transfers") - get(
            base, "transfers")) / n, 2), "fallback_ops": end.get("fallbacks", {})}


def _analyse(recs, warmup, script, dbg, fnt, notes) -> list[Finding]:
    if not recs or "compiles" not in recs[-1]:
        notes.append("note: no optimizer step ran on an XLA device (torch_xla was not used)"
                     if recs else "note: no optimizer step ran before the script ended")
        return []
    base, end, n = _window(recs, warmup)
    blocks = _blocks(_read(dbg, 0, end["PT_XLA_DEBUG_FILE"])) if os.path.exists(dbg) else []
    early = len(_blocks(_read(dbg, 0, base["PT_XLA_DEBUG_FILE"]))) if blocks else 0
    tracked = _tracked(_read(fnt, base["XLA_FNTRACKER_FILE"], end["XLA_FNTRACKER_FILE"])) \
        if os.path.exists(fnt) else []
    notes.append(f"run: {(end['executions'] - base['executions']) / n:.1f} executions/step "
                 f"after {warmup} warm-up steps ({n} steps measured)")
    seen: dict[tuple, int] = {}
    for i, b in enumerate(blocks[early:], early):
        where, cause = _user(b["frames"]), " ".join(b["cause"])
        same = [o for o in blocks[:i] if o["kind"] == "Compilation" and _user(o["frames"]) == where]
        why = ("a host read cut the graph here" if "tensor value" in cause else
               "the same graph with new input shapes (a ragged or padded batch?)"
               if any(o["inputs"] == b["inputs"] and o["hash"] != b["hash"] for o in same)
               else "a different graph was traced (a Python branch, a new shape or a cut)")
        if b["kind"] == "Compilation":
            seen[(where, f"({cause}): {why}")] = seen.get((where, f"({cause}): {why}"), 0) + 1
    out = [Finding("recompiles", "warning", script, (w or ("", 0))[1], f"{k} compile(s) after "
                   f"warm-up {why}", "one shape per step: drop_last=True, pad to a fixed length "
                   "or buckets; no host reads in the step", "Compilation Analysis (PT_XLA_DEBUG_"
                   "LEVEL), torch_xla/csrc/debug_util.cpp") for (w, why), k in seen.items()]
    reads = [w for op, w in tracked if op in ("_local_scalar_dense", "item")]
    reads += [w for b in blocks[early:] if "tensor value" in " ".join(b["cause"]) and b["kind"]
              != "Compilation" and (w := _user(b["frames"])) not in reads]
    per = (end["transfers"] - base["transfers"]) / n
    for where in {*reads} or ({None} if per else set()):
        out.append(Finding("host-transfers", "warning" if per >= 1 else "info", script,
                           (where or ("", 0))[1], f"{per:.1f} device-to-host transfers per step "
                           f"({reads.count(where)} from this line)", "read values in "
                           "xm.add_step_closure every N steps", "TransferFromDeviceTime, "
                           "torch_xla.debug.metrics"))
    ops = {}
    for op, where in tracked:
        if op not in ("_local_scalar_dense", "item"):
            ops.setdefault(where, set()).add(op)
    out += [Finding("cpu-fallback", "warning", script, (w or ("", 0))[1], "ran on the CPU (no XLA"
                    f" lowering), every step: aten::{', aten::'.join(sorted(o))}", "an op with a "
                    "lowering, or move it out of the step", "the fallback tracker "
                    "(XLA_FNTRACKER_FILE), torch_xla/csrc/aten_fallback.cpp")
            for w, o in ops.items()]
    return out


# --------------------------------------------------------------------------- entry points

def check(script: str, args=(), run: int | None = None, timeout: float = 300) -> Report:
    """Both passes over ``script`` (the dynamic one when ``run`` is a number of steps)."""
    report = Report(static_findings(Path(script).read_text(), script))
    if run:
        found, report.run, report.notes = dynamic_findings(script, args, run, timeout)
        report.findings += found
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpu-doctor", description=__doc__.split("\n")[0])
    p.add_argument("--run", type=int, metavar="N", help="also run N optimizer steps on XLA:CPU")
    p.add_argument("--timeout", type=float, default=300, help="seconds for --run (default 300)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    a = p.parse_args(argv)
    start = time.perf_counter()
    report = check(a.script, a.args, a.run, a.timeout)
    print(json.dumps(report.to_json(), indent=1) if a.json else
          f"{report.table()}\n({time.perf_counter() - start:.1f} s)")
    return report.exit_code


def load_ipython_extension(ipython) -> None:
    """``%tpu_doctor [--run N] SCRIPT [ARGS]`` in IPython/Jupyter (``%load_ext`` or import)."""
    ipython.register_magic_function(lambda line: main(shlex.split(line)) and None, "line",
                                    "tpu_doctor")


if "IPython" in sys.modules:  # imported in a notebook: register %tpu_doctor
    _ip = sys.modules["IPython"].get_ipython()
    if _ip is not None:
        load_ipython_extension(_ip)

if __name__ == "__main__":
    sys.exit(main())
