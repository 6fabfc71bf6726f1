"""Execute every notebook headless into an output folder and print notebook / status / seconds.

Usage: ``python scripts/run_notebooks.py [notebooks] [outputs] [--only NN ...]``
(``make run-notebooks``). Each notebook runs in a fresh kernel with ``notebooks/`` as its
working directory, exactly as nbmake runs it; the executed copy (with outputs and plots)
is written to ``outputs/NN_name.ipynb`` even when a cell fails. Exit status 1 if any
notebook failed or took longer than its budget (``metadata.tpu_notebooks.budget_seconds``,
at most 90 s; ``--budget`` overrides it for every notebook).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from notebook_template import budget_seconds  # this folder (scripts/) is on sys.path


def run_one(path: Path, out_dir: Path, timeout: int) -> tuple[str, float, str]:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    status, detail = "ok", ""
    try:
        client.execute()
    except CellExecutionError as exc:
        status = "FAILED"
        detail = str(exc).strip().splitlines()[-1][:120]
    except Exception as exc:  # timeouts, dead kernels
        status = "FAILED"
        detail = f"{type(exc).__name__}: {exc}"[:120]
    seconds = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (path.name + ".tmp")
    nbformat.write(nb, tmp)
    tmp.replace(out_dir / path.name)
    return status, seconds, detail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?", default="notebooks")
    ap.add_argument("out", nargs="?", default="outputs")
    ap.add_argument("--only", nargs="*", default=None, help="notebook number prefixes, e.g. 00 03")
    ap.add_argument("--timeout", type=int, default=300, help="per-cell timeout in seconds")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds allowed per notebook (default: each notebook's own budget)")
    args = ap.parse_args(argv)
    paths = sorted(Path(args.folder).glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        paths = [p for p in paths if p.name[:2] in args.only]
    if not paths:
        print(f"no notebooks in {args.folder}", file=sys.stderr)
        return 1
    rows = []
    for p in paths:
        print(f"running {p.name} ...", flush=True)
        status, seconds, detail = run_one(p.resolve(), Path(args.out), args.timeout)
        budget = args.budget or budget_seconds(p)
        if status == "ok" and seconds > budget:
            status, detail = "SLOW", f"over its {budget:.0f} s budget"
        rows.append((p.name, status, seconds, detail))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'notebook':{width}}  status  seconds  detail")
    for name, status, seconds, detail in rows:
        print(f"{name:{width}}  {status:6}  {seconds:7.1f}  {detail}")
    total = sum(r[2] for r in rows)
    bad = sum(r[1] != "ok" for r in rows)
    print(f"{'total':{width}}  {'ok' if not bad else f'{bad} bad':6}  {total:7.1f}")
    print(f"executed copies in {Path(args.out).resolve()}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
