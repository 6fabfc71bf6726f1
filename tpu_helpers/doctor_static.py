"""The rules of the doctor's static pass that ``doctor.py``'s ``_Static`` inherits: the calls
``doctor_rules.toml`` lists (``[[calls]]``), a sync in the step, replica hangs. It imports
``doctor_run.py`` (the catalogue), never the reverse: the ``--run`` child loads that file alone."""

from __future__ import annotations

import ast
import re
from importlib import metadata

try:  # inside the tpu_helpers package
    from . import doctor_run as dr
except ImportError:  # copied next to doctor_run.py into your project (or run as doctor.py)
    import doctor_run as dr  # type: ignore[no-redef]
CALLS, XM = dr.CALLS, dr.XM
_RANK, _WORLD, _COLL = map(re.compile, map(dr._CAT["patterns"].get, ("rank", "world", "coll")))


class StaticRules:
    """doctor.py's ``_Static`` inherits these: call rules, a sync in the step, replica hangs."""

    def call_rules(self, node: ast.Call, name: str, kw: dict) -> None:  # the toml's [[calls]]
        named, val = len(kw) == len(node.keywords), lambda e: self.reaching(e.id, e) or e if (
            isinstance(e, ast.Name)) else e  # a name: the value given it before (a dict...)
        for d in (val(k.value) for k in node.keywords if k.arg is None):  # **{...}: its keys too
            kw = {**{getattr(k, "value", 0): v for k, v in zip(getattr(d, "keys", ()), getattr(
                d, "values", ()), strict=True)}, **kw}
        for r in (r for r in CALLS if any(name == c or name.endswith("." + c) for c in r["call"])):
            e = val(kw.get(r.get("keyword", "")))
            i = next((kw[k] for k in r.get("index", ()) if k in kw), (node.args or [None])[0])
            if all(("given" not in r or (g := next((k for k in r["given"] if k in kw), None)),
                    "without" not in r or r["without"] not in kw and named,
                    "value" not in r or e is not None and self.value(e) == (True, r["value"]),
                    "contains" not in r or e is not None and r["contains"] in ast.unparse(e),
                    "index" not in r or i is not None and getattr(i, "value", 1) not in (0, None),
                    "file" not in r or re.search(r["file"], self.source),
                    "needs" not in r or not any(int(v.version.split(".")[0]) < r["needs"][1] for
                                                v in metadata.distributions(name=r["needs"][0])),
                    "replicas" not in r or self.per_replica(node),
                    "then" not in r or (use := self.then(node, r["then"])))):
                what = g if "given" in r else "index" in r and ast.unparse(node).replace(
                    XM, "xm") or "then" in r and f"{ast.unparse(node.func)}(...), then {use}" or ""
                self.add(node, r["kind"], what)

    def per_replica(self, node) -> bool:  # all replicas run it: no SPMD, no rank test around it
        return not self.spmd and (getattr(self.owner[node], "name", 0) in self.launched or not (
            self.launches) and any(re.search(r"^torch_xla\..*ordinal$", self.qual(c.func)) for c in
            self.calls)) and not any(isinstance(p, (ast.If, ast.IfExp)) and _RANK.search(
                ast.unparse(p.test)) for p in self.chain(node))

    def then(self, node, pattern: str) -> str | None:  # what takes a call's result next: a call
        top = node  # chained to it or given it; later in its def, a call given the name bound to it
        while isinstance(self.parents.get(top), (ast.Attribute, ast.Call)):
            top = self.parents[top]
        key = {ast.unparse(t) for t in getattr(self.parents.get(top), "targets", [])[:1]}
        later = [c for c in self.by_owner[self.owner[node]] if self.pos[c] >= self.end[node] and key
                 & {ast.unparse(e) for e in [getattr(c.func, "value", c), *c.args]}]
        return next((u for c in [*self.chain(node, self.parents.get(top)), *later] if isinstance(
            c, ast.Call) and re.search(pattern, u := f".{getattr(c.func, 'attr', '')}(" + ", ".join(
                map(ast.unparse, [*c.args, *c.keywords])) + ")")), None)

    def sync_in_step(self, scope) -> None:  # backward(); a sync; the optimizer step: two graphs
        calls = [c.value for c in self.own(scope) if isinstance(getattr(c, "value", 0), ast.Call)
                 and isinstance(c, ast.Expr)]
        body = lambda c: self.parents[self.parents[c]]  # noqa: E731  (the statement's block)
        for s in (s for s in calls if self.qual(s.func) in (f"{XM}.mark_step", "torch_xla.sync")):
            near = [(c.lineno > s.lineno, c) for c in calls if body(c) is body(s)]
            if (False, "backward") in [(a, getattr(c.func, "attr", "")) for a, c in near] and any(
                    a and self.is_step(c) for a, c in near):
                self.add(s, "sync-before-step", ast.unparse(s.func).replace(XM, "xm"))

    def replica_hangs(self) -> None:
        """Collectives some replicas skip (rank test, break, return); shards of unequal length."""
        gate = lambda n, stop=None: next((p for p in self.chain(n, stop) if isinstance(  # noqa: E731
            p, (ast.If, ast.IfExp)) and _RANK.search(ast.unparse(p.test))), None)  # `if rank...`
        coll = [c for c in self.calls if _COLL.search(self.qual(c.func))]
        key = lambda c: (self.owner[c], self.qual(c.func), ast.unparse(c.args[:1]))  # noqa: E731
        for c in (c for c in coll if gate(c) and [*map(key, coll)].count(key(c)) == 1):  # paired
            self.add(c, "collective-on-some-ranks", f"{ast.unparse(c.func)} under `if "  # (once
                     f"{ast.unparse(gate(c).test)}`".replace(XM, "xm"))  # per rank): fine
        for b in self.of.get(ast.Break, []) + self.of.get(ast.Return, []):
            loop = self.loop.get(b) if isinstance(b, ast.Break) else self.owner[b]
            start = self.pos[b if loop is self.owner[b] else loop]  # a return: what follows it
            if (g := gate(b, loop)) and any(start < self.pos[c] < self.end[loop] and not gate(c)
                                            for c in coll):
                self.add(b, "collective-on-some-ranks", f"{type(b).__name__.lower()} under `if "
                         f"{ast.unparse(g.test)}`, before a collective the others still call")
        for n in self.of.get(ast.Subscript, []) + self.calls:
            sl, a = getattr(n, "slice", None), getattr(n, "args", [])
            r, w = (sl.lower, sl.step) if isinstance(sl, ast.Slice) else (a[0], a[2]) if len(
                a) == 3 and self.qual(n.func) == "range" else (None, None)
            if r and w and _RANK.search(ast.unparse(r)) and _WORLD.search(ast.unparse(w)) and (
                    any(map(self.is_step, self.by_owner.get(self.owner[n], []))) or "train" in
                    ast.unparse(self.parents[n]).lower()):
                self.add(n, "uneven-shard", ast.unparse(n))
