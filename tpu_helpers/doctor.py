"""Check a training script before a TPU hour is spent: ``python -m tpu_helpers.doctor SCRIPT``.
Copy it with ``doctor_run.py``, ``doctor_static.py`` and ``doctor_rules.toml`` (standard library
only). The static pass reads a script with :mod:`ast` (never imports it) along its path on XLA."""

from __future__ import annotations

import ast
import re
import shlex
import sys

try:  # inside the tpu_helpers package
    from . import doctor_run as dr
    from . import doctor_static as ds
except ImportError:  # copied next to doctor_run.py and doctor_static.py (or run as doctor.py)
    import doctor_run as dr  # type: ignore[no-redef]
    import doctor_static as ds  # type: ignore[no-redef]
API, ENV, KINDS, RULES, STALE, XM = dr.API, dr.ENV, dr.KINDS, dr.RULES, dr.STALE, dr.XM
Finding, Report, Unreadable, dynamic_findings = (dr.Finding, dr.Report, dr.Unreadable,
                                                  dr.dynamic_findings)
#: Aliases the articles use without importing (a snippet continuing an earlier one).
ALIASES = {"xm": XM, "xmp": "torch_xla.distributed.xla_multiprocessing", "xr": "torch_xla.runtime",
           "pl": "torch_xla.distributed.parallel_loader", "met": "torch_xla.debug.metrics"}
LAUNCHERS = {"torch_xla.launch", f"{ALIASES['xmp']}.spawn", "torch_xla.torch_xla.launch"}
COMMON = {"num_cores": None, "drop_last": False}  # pytorch/xla test/args_parse.py, v1.8.0-v2.9.0
_DEFS, _LOOPS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda), (ast.For, ast.While)
_READS = {"item", "tolist", "numpy", "cpu"}
_HOST = {"len", "range", "int", "float", "str", "bool", "round", "enumerate", "zip", "dict", "list",
         "tuple", "set", "isinstance", "print", "open", "next", "iter", "time", "hasattr", "size",
         "getattr", "dim", "numel", "keys", "items", "values", "append", "update", *_READS}
_MODULE = re.compile(r"(?i)model|net$|module|optim|sched|encoder|decoder")  # names, not tensors
_META = {"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "grad_fn", "training"}
_XLA_NAME = re.compile(r"(?i)_*(use|is|on|has|with|using|run_on)?_?(torch_?)?(xla|tpu)s?(_?("
                       r"available|enabled|device|backend|mode))?")


# --------------------------------------------------------------------------- the static pass
def _dotted(node) -> str | None:  # "a.b.c" of a name or an attribute chain
    head = _dotted(node.value) if isinstance(node, ast.Attribute) else None
    return node.id if isinstance(node, ast.Name) else head and f"{head}.{node.attr}"


def _str(n): return n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
def _attr(n): return n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
def _kw(call): return {k.arg: k.value for k in call.keywords if k.arg}


def _targets(t) -> list[str]:
    return [t.id] if isinstance(t, ast.Name) else [x for e in getattr(t, "elts", [getattr(
        t, "value", None)] if isinstance(t, ast.Starred) else []) for x in _targets(e)]


class _Static(ds.StaticRules):
    def __init__(self, source: str, file: str):
        self.tree, self.file, self.source = ast.parse(source), file, source
        self.aliases, self.found, self.memo = dict(ALIASES), {}, {}
        self.order, self.pos, self.end, self.parents, self.owner, self.loop = [], {}, {}, {}, {}, {}
        self.of, self.binds, self.by_owner, self.assigned, self.funcs = {}, {}, {}, {}, {}
        stack = [(self.tree, self.tree, None)]
        while stack:  # one walk: source order, parents, the def and the loop each node is in
            node, own, loop = stack.pop()
            if own is None:
                self.end[node] = len(self.order)
                continue
            self.pos[node], self.owner[node], self.loop[node] = len(self.order), own, loop
            self.order.append(node)
            self.of.setdefault(type(node), []).append(node)
            stack.append((node, None, None))
            inner = node if isinstance(node, _DEFS) else own
            inloop = None if inner is node else node if isinstance(node, _LOOPS) else loop
            for child in reversed(list(ast.iter_child_nodes(node))):
                self.parents[child] = node
                stack.append((child, inner, loop if child is getattr(node, "iter", 0) else inloop))
        for n in self.order:  # bindings per def, in order; the values each name is given
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For)):
                self.binds.setdefault(self.owner[n], []).append(n)
            for t in n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                    n, ast.AnnAssign) and n.value else ():
                if key := _dotted(t):
                    self.assigned.setdefault((self.tree if "." in key else self.owner[n], key),
                                             []).append((self.pos[n], n.value))
        self.calls, self.defaults = self.of.get(ast.Call, []), {}
        for f in self.of.get(ast.FunctionDef, []) + self.of.get(ast.AsyncFunctionDef, []):
            self.funcs.setdefault(f.name, []).append(f)
        self.stored = {n.attr for n in self.of.get(ast.Attribute, []) if type(n.ctx) is ast.Store}
        for c in self.calls:  # calls per def; flags' defaults: argparse, absl, args_parse
            self.by_owner.setdefault(self.owner[c], []).append(c)
            name, kw, opts = _dotted(c.func) or "", _kw(c), [s for a in c.args if (s := _str(a))]
            act = _str(kw.get("action")) or ""
            if name.endswith("add_argument") and opts:
                dest = _str(kw.get("dest")) or next((o for o in opts if o[:2] == "--"), opts[0])
                self.defaults[dest.lstrip("-").replace("-", "_")] = kw.get("default", ast.Constant(
                    act == "store_false" if act in ("store_true", "store_false") else None))
            elif re.search(r"DEFINE_\w+$", name) and len(c.args) > 1 and opts:
                self.defaults[opts[0]] = c.args[1]
            elif name.endswith("parse_common_options"):
                self.defaults |= {k: kw.get(k, ast.Constant(v)) for k, v in COMMON.items()}

    def sub(self, n): return self.order[self.pos[n]:self.end[n]] if n in self.pos else [n]

    def own(self, scope) -> list:  # the nodes of scope outside nested defs (a step closure: fine)
        o = scope if isinstance(scope, _DEFS) else self.owner[scope]
        return self.memo.get(("own", scope)) or self.memo.setdefault(("own", scope), [
            n for n in self.sub(scope)[1:] if self.owner[n] is o])

    def chain(self, node, stop=None):
        while (node := self.parents.get(node)) not in (None, stop):
            yield node

    def qual(self, node) -> str:
        parts = (_dotted(node) or "").split(".")
        for k in range(min(len(parts), 3), 0, -1):  # xm.f, self._xm.f: aliases
            if got := self.aliases.get(".".join(parts[:k])):
                return ".".join([got, *parts[k:]])
        return ".".join(parts)

    def reaching(self, name: str, at):  # the value last given to name before at (its def; module)
        own = self.tree if "." in name else self.owner.get(at, self.tree)
        return next((vals[-1] for scope in dict.fromkeys((own, self.tree)) if (vals := [
            v for p, v in self.assigned.get((scope, name), ()) if scope is not own or p < self.pos[
                at] or "." in name])), None)

    def value(self, e) -> tuple[bool, object]:  # (known, value): literal, flag/parameter default
        if isinstance(e, ast.Attribute) and e.attr in self.defaults and e.attr not in self.stored:
            e = self.defaults[e.attr]
        elif isinstance(n := e, ast.Name):  # a parameter's default, or the value given before
            a = getattr(self.owner[n], "args", None)
            e = next((d for p, d in [*zip(a.args[::-1], a.defaults[::-1], strict=False), *zip(
                a.kwonlyargs, a.kw_defaults, strict=True)] if p.arg == n.id), None) if a else None
            e = e or self.reaching(n.id, n)
        return (True, e.value) if isinstance(e, ast.Constant) else (False, None)

    def add(self, node, kind, what="", row=None, note=None, sev=None) -> None:
        """One finding per line and kind; none on a path XLA skips; ``note``: info, saying that."""
        if self.dead(node):
            return
        line, rule = getattr(node, "lineno", 0), RULES[kind]
        msg, fix, src = (f"{what}: {row[1]}", row[2], row[3]) if row else rule[1:]
        msg = msg if row else msg.format(what) if "{}" in msg else f"{what} {msg}".strip()
        sev, old = "info" if note else sev or rule[0], self.found.get((line, kind))
        if old is None or old.severity == "info" != sev:
            self.found[line, kind] = Finding(kind, sev, self.file, line, note or msg, fix, src)

    # ------------------------------------------------------------------ the path taken on XLA
    def truth(self, e) -> bool | None:
        """A condition's value on XLA with torch_xla 2.8/2.9; None: unknown."""
        if ("t", e) not in self.memo:
            name = self.qual(e.func) if isinstance(e, ast.Call) else ""
            a, t = [_str(x) or "" for x in getattr(e, "args", [])[:2]] if name else [], None
            words = [w.lower() for x in [e.left, *e.comparators] for y in getattr(x, "elts", [x])
                     if (w := _str(y))] if isinstance(e, ast.Compare) and len(e.ops) == 1 else []
            if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
                t = None if (x := self.truth(e.operand)) is None else not x
            elif words and type(e.ops[0]) in (ast.Eq, ast.NotEq, ast.In, ast.NotIn) and (xla := any(
                    "xla" in w or "tpu" in w for w in words)) | all(re.fullmatch(
                        r"cuda(:\d+)?|gpu|nccl|mps", w) for w in words):  # device.type != "xla"
                t = xla is (type(e.ops[0]) in (ast.Eq, ast.In))
            elif isinstance(e, (ast.Name, ast.Attribute)):  # HAS_XLA, use_tpu, args.xla...
                t = _XLA_NAME.fullmatch(_attr(e)) and True
            elif name == "torch.cuda.is_available" or re.search(r"is_torch_(xla|tpu)_availa", name):
                t = "torch_" in name
            elif name in ("getattr", "hasattr") and len(a) > 1 and a[1]:  # (torch_xla, "sync")
                q = f"{self.qual(e.args[0])}.{a[1]}"
                t = API.get(q, ("",))[0] != "removed-api" if q.startswith("torch_xla") else None
            self.memo["t", e] = t
        return self.memo["t", e]

    def fallback(self, node) -> bool:
        """A try around torch_xla code 2.8/2.9 have: its ImportError handlers are old versions'."""
        if ("fb", node) not in self.memo:
            names = [self.qual(n) if isinstance(n, (ast.Attribute, ast.Name)) else (
                n.module or "") if isinstance(n, ast.ImportFrom) else n.names[0].name
                     for s in node.body for n in self.sub(s) if isinstance(n, (
                         ast.Attribute, ast.Name, ast.Import, ast.ImportFrom))]
            self.memo["fb", node] = any(q.startswith("torch_xla") for q in names) and not any(
                API.get(q, ("",))[0] == "removed-api" for q in names)
        return self.memo["fb", node]

    def cut(self, p, c) -> bool:  # is c skipped on XLA where its parent p branches?
        if isinstance(p, (ast.If, ast.IfExp, ast.While)) and c is not p.test:
            return self.truth(p.test) is (c not in p.body if isinstance(p.body, list) else
                                          c is not p.body)
        if isinstance(p, ast.BoolOp) and c is not p.values[0]:  # getattr(...) or xm.mark_step
            before = p.values[:[id(v) for v in p.values].index(id(c))]
            return any(self.truth(v) is isinstance(p.op, ast.Or) for v in before)
        return isinstance(p, ast.Try) and isinstance(c, ast.ExceptHandler) and c.type is not None \
            and {_attr(x) for x in getattr(c.type, "elts", [c.type])} <= {
                "ImportError", "ModuleNotFoundError", "AttributeError"} and self.fallback(p)

    def dead(self, node) -> bool:  # on a path XLA with torch_xla 2.8/2.9 does not take
        todo, memo = [node], self.memo.setdefault("dead", {})
        while todo[0] is not None and todo[0] not in memo:
            todo.insert(0, self.parents.get(todo[0]))
        for n in todo[1:]:
            memo[n] = memo.get(self.parents.get(n), False) or self.cut(self.parents.get(n), n)
        return memo.get(node, False)

    # ------------------------------------------------------------------ names, constants, calls
    def api(self, node, name: str) -> None:
        for key, row in ((k, r) for k, r in API.items() if f"{name}.".startswith(f"{k}.")):
            self.add(node, row[0], key.replace(XM, "xm"), row)

    def names(self) -> None:
        for node in self.of.get(ast.Import, []) + self.of.get(ast.ImportFrom, []):
            for a in node.names:  # imports first: they bind the aliases
                full = f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name
                short = full if a.asname or isinstance(node, ast.ImportFrom) else a.name
                self.aliases[a.asname or a.name.split(".")[0]] = short.split(".")[0] if (
                    short == a.name and not a.asname) else full
                self.api(node, full)
        modules, assigns = set(self.aliases.values()), self.of.get(ast.Assign, [])
        for a in assigns:  # self._xm = xm
            if (t := _dotted(a.targets[0])) and _dotted(a.value) and self.qual(a.value) in modules:
                self.aliases[t] = self.qual(a.value)
        launch = [c for c in self.calls if self.qual(c.func) in LAUNCHERS]
        self.launches = any(not self.dead(c) for c in launch)
        self.spmd = any(self.qual(c.func) == "torch_xla.runtime.use_spmd" for c in self.calls)
        self.launched = {"_mp_fn"} | {a.id for c in self.calls for a in c.args[:1] if isinstance(
            a, ast.Name) and (c in launch or _attr(c.func) == "notebook_launcher")}  # xla_spawn.py
        self.launched |= {_attr(c.func) for f in [*self.launched] for g in self.funcs.get(f, [])
                          for c in self.by_owner.get(g, [])}  # ... and what they call
        for node in self.of.get(ast.Attribute, []):
            if not isinstance(p := self.parents.get(node), ast.Attribute):
                self.api(node, q := self.qual(node))
                if q.startswith("torch.cuda.amp"):
                    self.add(node, "cuda-only", "torch.cuda.amp:", note=self.off(p))
                if q.startswith("torch_xla") and node.attr.startswith("is_") and isinstance(
                        p, (ast.Compare, ast.If, ast.IfExp, ast.BoolOp, ast.UnaryOp, ast.While)):
                    self.add(node, "predicate-not-called", q.replace(XM, "xm"))
        for node in self.of.get(ast.Constant, []):
            p, v = self.parents.get(node), node.value
            if v in ENV and (isinstance(p, ast.Subscript) and isinstance(p.ctx, ast.Store) or
                             isinstance(p, ast.Dict) or _attr(getattr(p, "func", None)) in (
                                 "setdefault", "putenv")):  # set, not only read
                self.add(node, ENV[v][0], v, ENV[v])
            elif v in STALE:
                self.add(node, "stale-env-setting", v)
        for node in self.calls:
            self.call(node, self.qual(node.func), _kw(node))

    def off(self, call) -> str | None:  # a CUDA AMP piece switched by enabled=<not True>: a note
        on = _kw(call).get("enabled") if isinstance(call, ast.Call) else None
        return on and getattr(on, "value", 0) is not True and f"a CUDA AMP piece with enabled=" \
            f"{ast.unparse(on)}: nothing fails on a TPU host; on XLA use torch.autocast('xla')"

    def call(self, node: ast.Call, name: str, kw: dict) -> None:
        attr, spawn = name.rsplit(".", 1)[-1], name in LAUNCHERS and name.endswith("spawn")
        strs = [s for x in (*node.args, *kw.values()) for a in self.sub(x) if (s := _str(a))]
        if name.endswith(".cuda") or any(c == "cuda" or c.startswith("cuda:") for c in strs):
            self.add(node, "cuda-only", note=self.off(node))
        n = kw.get("nprocs", node.args[2] if len(node.args) > 2 and spawn else None)
        (known, v), lit = self.value(n), isinstance(n, ast.Constant)
        text = f"{attr}(nprocs={ast.unparse(n) if n else ''}{'' if lit or not known else f', default {v!r}'}): "  # noqa: E501
        if name in LAUNCHERS and n is not None and not (spawn and lit and v in (None, 1)):
            ok = spawn and known and v in (None, 1)  # a flag whose default is accepted: a note
            self.add(node, "launch-nprocs", text + ("ValueError: xmp.spawn takes only None (every "
                     "device) or 1" if spawn else "torch_xla.launch has no nprocs parameter: "
                     "TypeError, even for None or 1"), note=ok and text + "accepted as it is by "
                     "default; a ValueError if it is set to anything but None or 1" or None)
        backend = _str(kw.get("backend", node.args[0] if node.args else None))
        if attr == "init_process_group" and (backend == "nccl" or backend == "gloo" and re.search(
                r"torch_xla|jax|TPU|tpu", self.source) and not self.spmd):
            self.add(node, "wrong-backend", repr(backend))
        self.call_rules(node, name, kw)  # doctor_rules.toml's [[calls]] (doctor_static.py)
        for k, i in (("num_replicas", 1), ("rank", 2)) if attr.startswith(
                "DistributedSampler") and self.launches else ():
            e = kw.get(k, node.args[i] if len(node.args) > i else None)
            e is not None and self.from_env(e) and self.add(node, "rank-from-env", f"{k}="
                                                            f"{ast.unparse(e)}")

    def from_env(self, e, depth: int = 0) -> bool:  # from LOCAL_RANK, RANK or WORLD_SIZE?
        return bool(re.search(r"(environ|getenv)\W.*\b(LOCAL_)?(RANK|WORLD_SIZE)\b", ast.unparse(
            e))) or depth < 2 and any(v is not None and self.from_env(v, depth + 1) for n in
                                      self.sub(e) for v in [self.defaults.get(n.attr) if isinstance(
                                          n, ast.Attribute) and n.attr not in self.stored else
                                      self.reaching(n.id, n) if isinstance(n, ast.Name) else None])

    # ------------------------------------------------------------------ the training step
    def is_step(self, c: ast.Call) -> bool:
        a, on = _attr(c.func), _dotted(getattr(c.func, "value", None))  # x.backward(), opt.step()
        return a in ("backward", "optimizer_step") or a in self.step_fns and (
            a != "step" or on == "self") or a == "step" and any(re.search(
            r"opt", x or "", re.I) for x in (on, *map(_dotted, c.args[:1])))

    def scopes(self) -> list:  # loops that step an optimizer themselves; step functions
        self.step_fns = {"training_step"} & set(self.funcs)
        while new := {f.name for fs in self.funcs.values() for f in fs if f.name not in
                      self.step_fns and any(self.loop[c] is None and self.is_step(c)
                                            for c in self.by_owner.get(f, ()))}:
            self.step_fns |= new
        loops = {self.loop[c] for c in self.calls if self.loop[c] and self.is_step(c)}
        return sorted(loops, key=self.pos.get) + [f for n in self.step_fns for f in self.funcs[n]]

    def deviceish(self, e, depth: int = 0) -> bool:  # gives device batches (MpDeviceLoader...)?
        return any(re.search(r"DeviceLoader|ParallelLoader|per_device|para_load|device_load",
                             _attr(n)) or depth < 3 and isinstance(n, ast.Name) and (
            v := self.reaching(n.id, n)) is not None and v is not e and self.deviceish(
                v, depth + 1) for n in self.sub(e))

    def tensors(self, scope) -> set[str]:  # names holding XLA tensors there (a guess, no proof)
        names = {"loss", "output", "outputs", "logits", "pred", "preds"}
        for b in self.binds.get(self.owner[scope] if isinstance(scope, _LOOPS) else scope, ()):
            v, loop = (b.iter, True) if isinstance(b, ast.For) else (b.value, False)
            if self.pos[b] > self.end[scope]:
                break
            pairs = [(t, v) for t in (b.targets if isinstance(b, ast.Assign) else [b.target])]
            if isinstance(v, ast.Tuple) and isinstance(pairs[0][0], ast.Tuple):
                pairs = list(zip(pairs[0][0].elts, v.elts, strict=False))
            skip = loop and _attr(getattr(v, "func", None)) == "enumerate"  # (i, batch)
            for t, x in pairs:  # a device loader's batch, or a device value
                on = self.deviceish(x) if loop or _attr(getattr(x, "func", None)) == "next" else \
                    self.devexpr(x, names)
                for m in _targets(ast.Tuple(t.elts[1:]) if skip and isinstance(
                        t, ast.Tuple) else t) if on or not isinstance(b, ast.AugAssign) else ():
                    (names.add if on and not _MODULE.search(m) else names.discard)(m)
        return names

    def devexpr(self, e, names: set[str]) -> bool:
        """Does ``e`` hold a device tensor's value (not only its shape, its identity, a length)?"""
        if isinstance(e, ast.Compare) and all(type(o) in (ast.Is, ast.IsNot, ast.In, ast.NotIn)
                                              for o in e.ops) or isinstance(e, ast.Lambda):
            return False
        f, recv = _attr(getattr(e, "func", None)), getattr(getattr(e, "func", None), "value", None)
        if isinstance(e, ast.Call) and (f in _HOST or f == "to" and "'cpu'" in ast.unparse(e)):
            return False  # len(x), x.item() (the read itself), x.to("cpu")...
        if isinstance(e, ast.Call) and (f in self.step_fns or "device" in _kw(e) or re.search(
                r"(?i)loss|criterion|forward|model$|net$|step", f) or f == "to" and not re.search(
                r"(?i)model|net|module|^[A-Z]", ast.unparse(recv))):
            return True  # a model's or a loss's output, x.to(device), torch.zeros(..., device=d)
        return e.id in names if isinstance(e, ast.Name) else not (isinstance(
            e, ast.Attribute) and e.attr in _META) and any(self.devexpr(x, names) for x in (
                ast.iter_child_nodes(e)) if isinstance(x, ast.expr))

    def read(self, n, names: set[str], scope) -> str | None:
        """What in ``n`` reads a device tensor on the host: ``.item()``, ``float()``, ``if``..."""
        f, name = getattr(n, "func", None), _dotted(getattr(n, "func", None)) or ""
        if isinstance(f, ast.Attribute) and (f.attr in _READS and not n.args or f.attr == "to" and
                                             any(_str(a) == "cpu" for a in n.args)):
            return f".{f.attr}()" if self.devexpr(f.value, names) else None
        if name in ("float", "int", "bool", "str") and n.args and self.devexpr(n.args[0], names):
            return f"{name}(tensor)"
        if name.endswith("print") and any(self.devexpr(a, names) for a in n.args):
            return "print(tensor)"
        if isinstance(n, ast.FormattedValue) and self.devexpr(n.value, names):
            return "f'{tensor}'"
        return "if tensor" if isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert)) and (
            n is not scope) and self.devexpr(n.test, names) else None

    def rare(self, t, body: bool = True) -> bool:  # true only every N steps (false: for else)?
        if isinstance(t, ast.BoolOp) and body:  # ...and x; or step == last
            parts = [self.rare(v) for v in t.values]
            return any(parts) and (isinstance(t.op, ast.And) or all(p or isinstance(
                v, ast.Compare) and isinstance(v.ops[0], ast.Eq) for p, v in zip(
                    parts, t.values, strict=True)))
        x, neg = (t.operand, True) if isinstance(t, ast.UnaryOp) and isinstance(
            t.op, ast.Not) else (t, False)
        eq = isinstance(x, ast.Compare) and isinstance(x.ops[0], (ast.Eq, ast.NotEq)) and getattr(
            x.comparators[0], "value", None) == 0
        mod, mult = (x.left, isinstance(x.ops[0], ast.Eq) != neg) if eq else (x, neg)
        return isinstance(mod, ast.BinOp) and isinstance(mod.op, ast.Mod) and mult is body

    def gated(self, n, scope, what: str) -> str | None:  # runs every N steps only: an info note
        child = n
        for p in self.chain(n, scope):
            if isinstance(p, ast.If) and self.rare(p.test, child in p.body) and not any(
                    isinstance(c, ast.Call) and self.is_step(c) for c in self.sub(p)):
                return (f"{what} under `if {ast.unparse(p.test)}`: a host read every N steps, not "
                        "every step; outside a step closure it still waits for the device there")
            child = p
        return None

    def masked(self, n, scope) -> bool:  # x[mask], nonzero(), one-argument torch.where...
        masks = self.memo.setdefault(("mask", scope), {t for m in self.own(scope) if isinstance(
            m, ast.Assign) and isinstance(m.value, ast.Compare) for t in _targets(m.targets[0])})
        name = self.qual(n.func) + f"/{len(n.args)}" if isinstance(n, ast.Call) else ""
        return isinstance(n, ast.Subscript) and (isinstance(n.slice, ast.Compare) or _attr(
            n.slice) in masks) or bool(re.search(r"\.nonzero/|masked_select/|torch\.unique/|^torch"
                                                 r"\.where/1$", name))

    def loaders(self, scopes) -> None:
        """Training DataLoaders (a training loop iterates them, through wrappers; a name or def
        saying train; shuffle=True): a sampler in the replicas, drop_last (a flag's default)."""
        loops = [s for s in scopes if isinstance(s, ast.For)]  # (def, name) they iterate, and
        feed = {(self.owner[s], n.id) for s in loops for n in self.sub(s.iter) if isinstance(
            n, ast.Name)}  # what those were made from (ParallelLoader(x).per_device_loader()...)
        for _ in range(3):
            feed |= {(o, n.id) for s in loops for o, f in list(feed) if o is self.owner[s] for n
                     in self.sub(self.reaching(f, s) or s.target) if isinstance(n, ast.Name)}
        many = not self.spmd and (self.launches or any(_attr(c.func) == "init_process_group"
                                                       for c in self.calls))
        for n in (c for c in self.calls if re.fullmatch(r"(.*\.)?DataLoader", self.qual(c.func))):
            kw, at = _kw(n), next((p for p in self.chain(n) if isinstance(p, (
                ast.Assign, ast.FunctionDef))), None)
            name = " ".join(map(ast.unparse, getattr(at, "targets", []))) or getattr(at, "name", "")
            fed = {(self.owner[n], x) for x in name.split()} & feed
            if not (fed or not re.search(r"test|val|eval|predict|infer", name, re.I) and (
                    "train" in name.lower() or self.value(kw.get("shuffle")) == (True, True))):
                continue  # evaluation: every replica may score everything, one more shape is fine
            sampler = kw.get("sampler", kw.get("batch_sampler", (n.args[3:] or [None])[0]))
            if many and (sampler is None or getattr(sampler, "value", 0) is None) and (fed or
                    getattr(self.owner[n], "name", "") in self.launched or not self.launches):
                self.add(n, "no-distributed-sampler")
            d = kw.get("drop_last", ast.Constant(False))
            (known, drop), flag = self.value(d), f"drop_last={ast.unparse(d)}"
            if "batch_sampler" not in kw and not (known and drop):
                self.add(n, "ragged-batches", f"{flag} ({drop} by default):" * (not isinstance(
                    d, ast.Constant)), note=None if known else f"{flag}: not known here; unless it "
                    "is True, the smaller last batch compiles a second graph")

    def run(self) -> list[Finding]:
        self.names()
        for scope in (scopes := self.scopes()):  # host reads, data-dependent shapes in the step
            names = self.tensors(scope)
            for n in self.own(scope):
                if w := self.read(n, names, scope):
                    self.add(n, "host-read-in-loop", w, note=self.gated(n, scope, w))
                self.masked(n, scope) and self.add(n, "dynamic-shape")
            self.sync_in_step(scope)
        self.loaders(scopes)
        self.replica_hangs()
        return list(self.found.values())


def static_findings(source: str, file: str = "<script>", shell=None) -> list[Finding]:
    """The static pass over ``source`` (never imported or run); ``shell``: its shell lines."""
    try:
        return sorted(_Static(source, file).run() + dr.shell_findings(source, shell or {}, file),
                      key=lambda f: (f.line, f.kind))
    except SyntaxError as exc:
        return [Finding("crash", "error", file, exc.lineno or 0, f"SyntaxError: {exc.msg}", "")]


def check(script: str, args=(), run: int | None = None, timeout: float = 300) -> Report:
    """Both passes over a script or a notebook (``run`` steps: scripts); or :class:`Unreadable`."""
    return dr.checked(static_findings, script, args, run, timeout)


def main(argv: list[str] | None = None) -> int: return dr.command_line(check, argv, __doc__[:71])


def load_ipython_extension(ipython) -> None:  # %tpu_doctor [--run N] SCRIPT [ARGS]; alone: this
    ipython.register_magic_function(lambda a: main(shlex.split(a)) and None, "line", "tpu_doctor")


if "IPython" in sys.modules and (_ip := sys.modules["IPython"].get_ipython()) is not None:
    load_ipython_extension(_ip)  # imported in a notebook: register %tpu_doctor
if __name__ == "__main__":
    sys.exit(main())
