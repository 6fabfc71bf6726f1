"""The notebook template, in one place: badges, the setup cell, and the checker.

Every notebook in ``notebooks/`` follows the template written down in
``notebooks/README.md``. This module is the single source of truth for the parts that
must be identical everywhere (the repository URL, the badges, the setup cell) and checks
the rest. ``tests/test_notebook_template.py`` runs the checker on every notebook and on
deliberately broken copies.

Command line::

    python -m tpu_helpers.notebook_template --check notebooks   # exit 1 on any problem
    python -m tpu_helpers.notebook_template --write notebooks   # re-render badges + setup
    python -m tpu_helpers.notebook_template --write notebooks/03_multicore_training.ipynb
    python -m tpu_helpers.notebook_template --strip notebooks   # drop outputs and counts
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: The one place the repository lives. Badges and the setup cell are rendered from it.
REPO_SLUG = "tpu-notebooks/tpu-notebooks"
REPO_URL = f"https://github.com/{REPO_SLUG}"
BRANCH = "main"

COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
KAGGLE_BADGE = "https://kaggle.com/static/images/open-in-kaggle.svg"

SETUP_MARKER = "# Setup (safe to re-run)"
CONFIG_MARKER = "# Config"

_NAME = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")


def colab_url(name: str) -> str:
    """The "Open in Colab" link for ``notebooks/<name>``."""
    return f"https://colab.research.google.com/github/{REPO_SLUG}/blob/{BRANCH}/notebooks/{name}"


def kaggle_url(name: str) -> str:
    """The "Open in Kaggle" link for ``notebooks/<name>``."""
    return f"https://kaggle.com/kernels/welcome?src={REPO_URL}/blob/{BRANCH}/notebooks/{name}"


def badges(name: str) -> str:
    """Markdown for both badges of one notebook, on one line."""
    return (
        f"[![Open In Colab]({COLAB_BADGE})]({colab_url(name)}) "
        f"[![Open in Kaggle]({KAGGLE_BADGE})]({kaggle_url(name)})"
    )


def setup_cell() -> str:
    """The setup cell every notebook starts with (identical in all of them).

    Locally (this repo's venv has ``tpu_helpers`` installed) it only prints where it runs.
    On Colab/Kaggle it clones the repo once (for ``data/`` and ``tpu_helpers``) and
    ``setup_notebook()`` installs the matched torch/torch_xla pair only if missing.
    """
    return f'''{SETUP_MARKER}: on Colab/Kaggle installs the matched torch/torch_xla pair
# and this repo's tpu_helpers only if missing; on your own machine it installs nothing.
import importlib.util
import os
import subprocess
import sys

REPO_URL = "{REPO_URL}"
if importlib.util.find_spec("tpu_helpers") is None:
    _home = next((d for d in ("/kaggle/working", "/content") if os.path.isdir(d)), os.getcwd())
    _clone = os.path.join(_home, "tpu-notebooks")
    if not os.path.isdir(_clone):
        subprocess.run(["git", "clone", "-q", "--depth", "1", REPO_URL, _clone], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", _clone],
                   check=True)
    sys.path.insert(0, _clone)

from tpu_helpers.env import setup_notebook

RUNTIME = setup_notebook()'''


# --------------------------------------------------------------------------- checking


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _next_notebook(path: Path) -> str | None:
    """File name of the notebook after ``path`` in the course, or None for the last one."""
    later = sorted(p.name for p in path.parent.glob("[0-9][0-9]_*.ipynb") if p.name > path.name)
    return later[0] if later else None


def check_notebook(path: str | Path) -> list[str]:
    """Return the template problems of one notebook (an empty list means it conforms)."""
    path = Path(path)
    name = path.name
    problems: list[str] = []
    if not _NAME.match(name):
        problems.append(f"name {name!r} is not NN_lowercase_words.ipynb")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"cannot read as notebook JSON: {exc}"]
    cells = nb.get("cells", [])
    if len(cells) < 5:
        return problems + [f"only {len(cells)} cells; the template needs at least 5"]

    first = cells[0]
    head = _source(first)
    if first.get("cell_type") != "markdown" or not head.startswith("# "):
        problems.append("cell 1 must be markdown starting with a '# Title'")
    if f"]({colab_url(name)})" not in head or COLAB_BADGE not in head:
        problems.append(f"cell 1 lacks the Open in Colab badge for {name}")
    if f"]({kaggle_url(name)})" not in head or KAGGLE_BADGE not in head:
        problems.append(f"cell 1 lacks the Open in Kaggle badge for {name}")
    if "what you will learn" not in head.lower():
        problems.append("cell 1 lacks a 'What you will learn' section")

    code = [c for c in cells if c.get("cell_type") == "code"]
    if not code or _source(code[0]) != setup_cell():
        problems.append("the first code cell is not the canonical setup cell (run `make template`)")
    if sum(_source(c).startswith(SETUP_MARKER) for c in code) > 1:
        problems.append("more than one setup cell")
    if len(code) < 2 or not _source(code[1]).startswith(CONFIG_MARKER):
        problems.append(f"the second code cell must be the config cell starting {CONFIG_MARKER!r}")
    elif "os.environ" not in _source(code[1]):
        problems.append("the config cell must read its CI/smoke settings from os.environ")
    if sum(_source(c).startswith(CONFIG_MARKER) for c in code) > 1:
        problems.append("more than one config cell")
    if not any(re.search(r"^\s*assert\b", _source(c), re.M) for c in code):
        problems.append("no cell asserts a claim")

    md = [_source(c) for c in cells if c.get("cell_type") == "markdown"]
    learned = [i for i, s in enumerate(md) if re.search(r"^#+ What you learned", s, re.M)]
    if not learned:
        problems.append("no '## What you learned' section")
    tail = "\n".join(md[learned[-1]:]) if learned else ""
    nxt = _next_notebook(path)
    if nxt and f"]({nxt})" not in tail:
        problems.append(f"'What you learned' must end with a link to the next notebook ({nxt})")
    planned = re.search(rf"\]\({int(name[:2]) + 1:02d}_[a-z0-9_]+\.ipynb\)", tail) if _NAME.match(
        name) else None
    if not nxt and "](../README.md)" not in tail and not planned:
        problems.append("the last notebook must link back to ../README.md")

    for i, c in enumerate(cells, 1):
        if c.get("cell_type") == "code" and (c.get("outputs") or c.get("execution_count")):
            problems.append(f"cell {i} has committed outputs or an execution count (make strip)")
    return problems


# --------------------------------------------------------------------------- rewriting


def _set_source(cell: dict[str, Any], text: str) -> None:
    lines = text.splitlines(keepends=True)
    cell["source"] = lines


def strip(nb: dict[str, Any]) -> dict[str, Any]:
    """Drop outputs, execution counts and per-run metadata (in place; returns nb).

    Also gives every cell a stable id where the format (4.5+) wants one.
    """
    wants_ids = (nb.get("nbformat", 4), nb.get("nbformat_minor", 0)) >= (4, 5)
    taken = {c["id"] for c in nb.get("cells", []) if c.get("id")}
    for i, c in enumerate(nb.get("cells", [])):
        if wants_ids and not c.get("id"):
            new_id = f"cell-{i:02d}"
            while new_id in taken:
                new_id += "x"
            c["id"] = new_id
            taken.add(new_id)
        if c.get("cell_type") == "code":
            c["outputs"] = []
            c["execution_count"] = None
        meta = c.get("metadata", {})
        for k in ("execution", "collapsed", "scrolled"):
            meta.pop(k, None)
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def render(path: Path) -> dict[str, Any]:
    """Return the notebook with its badge line and setup cell re-rendered from here."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    head = _source(cells[0])
    lines = [ln for ln in head.splitlines() if COLAB_BADGE not in ln and KAGGLE_BADGE not in ln]
    title_end = 1 if lines and lines[0].startswith("# ") else 0
    lines[title_end:title_end] = ["", badges(path.name)]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    _set_source(cells[0], text)
    code = [c for c in cells if c.get("cell_type") == "code"]
    if code and _source(code[0]).startswith(SETUP_MARKER):
        _set_source(code[0], setup_cell())
    else:
        new = {"cell_type": "code", "metadata": {}, "source": [], "outputs": [],
               "execution_count": None}
        _set_source(new, setup_cell())
        cells.insert(1, new)
    return strip(nb)


def _write(path: Path, nb: dict[str, Any]) -> None:
    tmp = path.with_suffix(".ipynb.tmp")
    tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def notebooks(folder: str | Path) -> list[Path]:
    """The course notebooks in ``folder``, in order."""
    return sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--strip", action="store_true")
    ap.add_argument("paths", nargs="*", default=["notebooks"],
                    help="notebook files, or folders of NN_*.ipynb notebooks")
    args = ap.parse_args(list(argv) if argv is not None else None)
    paths = [p for arg in args.paths
             for p in (notebooks(arg) if Path(arg).is_dir() else [Path(arg)])]
    if not paths:
        print(f"no NN_*.ipynb notebooks in {' '.join(args.paths)}", file=sys.stderr)
        return 1
    bad = 0
    for p in paths:
        if args.write:
            _write(p, render(p))
        elif args.strip:
            nb = json.loads(p.read_text(encoding="utf-8"))
            _write(p, strip(nb))
        else:
            for problem in check_notebook(p):
                print(f"{p}: {problem}", file=sys.stderr)
                bad += 1
    if args.check:
        print(f"template: {len(paths)} notebooks, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
