"""Per-notebook figures for the course's shape: code cells, body lines, the share of body cells
that assert, lines that use the torch_xla API, the setup cell's length and (from an executed
copy, e.g. ``make run-notebooks``'s ``outputs/``) the stderr lines a learner sees.

Usage: ``python scripts/notebook_stats.py [notebooks] [--executed outputs]``. "Body" is every
code cell after the setup cell; a body line is a non-blank line that is not only a comment.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

XLA_NAMES = re.compile(r"\b(torch_xla|xm|xr|pl|met|xs|xmp|xu|xp|spmd)\.")


def _lines(cell) -> list[str]:
    src = "".join(cell["source"])
    return [ln for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _asserts(cell) -> bool:
    src = "".join(cell["source"])
    src = "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!")))
    try:
        return any(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(src)))
    except SyntaxError:
        return "assert " in src


def stderr_lines(nb) -> int:
    n = 0
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                n += len([ln for ln in "".join(out["text"]).splitlines() if ln.strip()])
    return n


def stats(path: Path, executed: Path | None = None) -> dict:
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    body = code[1:]
    lines = [ln for c in body for ln in _lines(c)]
    row = {
        "notebook": path.name[:2],
        "code cells": len(code),
        "body lines": len(lines),
        "assert lines": sum(ln.lstrip().startswith("assert") for ln in lines),
        "cells asserting %": round(100 * sum(map(_asserts, body)) / max(len(body), 1)),
        "torch_xla lines": sum(bool(XLA_NAMES.search(ln)) for ln in lines),
        "setup cell lines": len("".join(code[0]["source"]).splitlines()) if code else 0,
    }
    if executed is not None:
        ex = executed / path.name
        row["stderr lines"] = stderr_lines(json.loads(ex.read_text())) if ex.exists() else None
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?", default="notebooks")
    ap.add_argument("--executed", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = [stats(p, args.executed) for p in sorted(Path(args.folder).glob("[0-9][0-9]_*.ipynb"))]
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    tot = {k: sum(r[k] or 0 for r in rows) for k in ("code cells", "body lines", "assert lines",
                                                    "torch_xla lines")}
    print("total:", tot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
