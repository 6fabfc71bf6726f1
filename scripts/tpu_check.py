"""Record a real TPU run: every notebook at full settings, one row per notebook, committed.

A maintainer runs this on a TPU VM, in Colab or in Kaggle (TPU runtime, Internet on),
from a clone of this repository, in the platform's own Python, after ``pip install --no-deps
-e .`` in the clone (then the notebooks' setup cells find this clone's package and install
nothing; a setup cell run first would install GitHub's ``main`` instead)::

    python scripts/tpu_check.py                # or: make tpu-check
    git add results/tpu_runs.json README.md && git commit -m "TPU run record"

It refuses to run without a TPU (a record says what ran where, so an XLA:CPU run must
never be recorded as a TPU run). Each notebook runs in a fresh kernel, as a learner
runs it, with ``CI`` and ``SMOKE`` unset (full settings). The record (platform, TPU
generation and chips, Python, torch / torch_xla / libtpu versions, per-notebook status and
seconds) is appended to ``results/tpu_runs.json``; the README's "TPU run record" block
between its markers is regenerated from the newest record ("No TPU run recorded yet."
while there is none). ``--allow-cpu`` exists for this script's own test and never writes
to the repository's files unless they are passed explicitly.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from course.setup import installed_versions  # noqa: E402
from tpu_helpers.checkpoint import atomic_write  # noqa: E402
from tpu_helpers.env import detect_runtime  # noqa: E402

RESULTS = REPO / "results" / "tpu_runs.json"
README = REPO / "README.md"
START, END = "<!-- tpu-run-record:start -->", "<!-- tpu-run-record:end -->"
NONE_YET = "No TPU run recorded yet."


def run_notebook(path: Path, timeout: int) -> tuple[str, float, str]:
    """Execute one notebook in a fresh kernel (notebooks/ as cwd); status, seconds, detail."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()
        status, detail = "ok", ""
    except Exception as exc:  # a failed cell, a timeout, a dead kernel: record it
        status = "FAILED"
        lines = str(exc).strip().splitlines()
        detail = (lines[-1] if lines else type(exc).__name__)[:160]
    return status, round(time.perf_counter() - start, 1), detail


def environment() -> dict[str, object]:
    rt = detect_runtime()
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": rt.platform, "tpu": rt.accelerator_type or rt.tpu_generation,
        "tpu_generation": rt.tpu_generation, "chips": rt.chips,
        "python": platform.python_version(),
        **{name: installed_versions().get(name)
           for name in ("torch", "torch-xla", "libtpu", "lightning")},
    }


def render(records: list[dict]) -> str:
    """The README block: the newest record as a table, or that there is none."""
    if not records:
        return NONE_YET
    rec = records[-1]
    env = rec["environment"]
    head = (f"Latest of {len(records)} recorded run(s): {env['date']}, {env['platform']}, "
            f"TPU {env['tpu']} ({env['chips']} chip(s)), Python {env['python']}, "
            f"torch {env['torch']}, torch_xla {env['torch-xla']}, libtpu {env['libtpu']}.")
    rows = ["| notebook | status | seconds | detail |", "|---|---|---|---|"]
    rows += [f"| {r['notebook']} | {r['status']} | {r['seconds']} | {r['detail']} |"
             for r in rec["notebooks"]]
    return head + "\n\n" + "\n".join(rows)


def update_readme(readme: Path, records: list[dict]) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: no {START} ... {END} block to update")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    block = f"{START}\n{render(records)}\n{END}"
    atomic_write(readme, lambda f: f.write((before + block + after).encode()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notebooks", default=str(REPO / "notebooks"))
    ap.add_argument("--only", nargs="*", help="notebook number prefixes, e.g. 00 03")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--readme", default=str(README))
    ap.add_argument("--timeout", type=int, default=1800, help="per-cell timeout (seconds)")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run without a TPU (this script's test only; the record says so)")
    args = ap.parse_args(argv)
    env = environment()
    if env["tpu_generation"] is None and not args.allow_cpu:
        print("No TPU here: a TPU run record needs a TPU VM, Colab or Kaggle with a TPU "
              "runtime. Nothing was recorded.", file=sys.stderr)
        return 2
    for var in ("CI", "SMOKE"):  # full settings, as a learner runs them
        os.environ.pop(var, None)
    paths = sorted(Path(args.notebooks).glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        paths = [p for p in paths if p.name[:2] in args.only]
    rows = []
    for p in paths:
        print(f"running {p.name} ...", flush=True)
        status, seconds, detail = run_notebook(p.resolve(), args.timeout)
        rows.append({"notebook": p.name, "status": status, "seconds": seconds,
                     "detail": detail})
        print(f"  {status} in {seconds} s {detail}", flush=True)
    results = Path(args.results)
    records = json.loads(results.read_text()) if results.is_file() else []
    records.append({"environment": env, "notebooks": rows})
    atomic_write(results, lambda f: f.write((json.dumps(records, indent=1) + "\n").encode()))
    update_readme(Path(args.readme), records)
    print(render(records))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
