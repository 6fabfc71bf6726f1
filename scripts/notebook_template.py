"""The notebook template, in one place: badges, the setup cell, and the checker.

Every notebook in ``notebooks/`` follows the template written down in
``notebooks/README.md``. This module is the single source of truth for the parts that
must be identical everywhere (the repository URL, the badges, the setup cell) and checks
the rest. ``tests/test_notebook_template.py`` runs the checker on every notebook and on
deliberately broken copies.

Command line::

    python scripts/notebook_template.py --check notebooks   # exit 1 on any problem
    python scripts/notebook_template.py --write notebooks   # re-render badges + setup
    python scripts/notebook_template.py --write notebooks/03_multicore_training.ipynb
    python scripts/notebook_template.py --strip notebooks   # drop outputs and counts
    python scripts/notebook_template.py --readme README.md  # the course table from metadata

Each notebook's top-level metadata carries what it teaches, which devices it uses and its
time budget (:data:`COURSE_KEY`); the checker validates it, ``scripts/notebook_budget.py``
enforces the budget and ``--readme`` renders the README's course table from it.
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
#: The closing section that holds a notebook's evidence (scripts/course_text.py keeps it there).
CHECKED_HEADING = "How this notebook is checked"

#: Top-level notebook metadata with which Colab and Kaggle open a notebook on a TPU runtime.
#: Colab: ``accelerator`` + ``colab.gpuType`` as Colab itself saves them for a v5e-1 TPU.
#: Kaggle: the ``kaggle`` block of its own exports; the TPU value ``tpuV5e8`` is the best
#: evidence found, not confirmed from a Kaggle export, hence :data:`RUNTIME_LINE` in cell 1.
#: Never ``kaggle.dockerImageVersionId``: it pins a CPU/GPU image (Kaggle/kaggle-cli#1197).
NOTEBOOK_METADATA: dict[str, Any] = {
    "accelerator": "TPU",
    "colab": {"provenance": [], "gpuType": "V5E1"},
    "kaggle": {"accelerator": "tpuV5e8", "dataSources": [], "isGpuEnabled": False,
               "isInternetEnabled": True, "language": "python", "sourceType": "notebook"},
}
RUNTIME_PREFIX = "**Runtime:**"
#: The line under the badges saying which menu to click when no TPU came with the notebook.
RUNTIME_LINE = (f"{RUNTIME_PREFIX} the badges ask for a TPU. If you get none, pick it by hand: "
                "Colab: *Runtime > Change runtime type > v5e-1 TPU*; Kaggle: *Settings > "
                "Accelerator > TPU VM v5e-8*, and *Settings > Internet on* (the setup cell "
                "downloads this repository; with Internet off, attach its wheels instead: "
                "[Kaggle with Internet off](../README.md#kaggle-with-internet-off)).")

_NAME = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")

#: The course's own block in each notebook's top-level metadata, e.g.
#: ``"tpu_notebooks": {"teaches": ["short item", ...], "devices": "One sentence.",
#: "budget_seconds": 90}``: what it teaches, what devices it uses here and on a TPU, and the
#: seconds it may take alone on a 2-core CPU machine with ``CI=true`` (at most 90).
COURSE_KEY = "tpu_notebooks"
MAX_BUDGET_S = 90
#: Longest "teaches" item and "devices" sentence (they fill a README table cell).
MAX_TEACH_CHARS = 90
MAX_DEVICES_CHARS = 240
README_START, README_END = "<!-- course-table:start -->", "<!-- course-table:end -->"


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


#: Environment variable naming another source of this repository's package for the setup cell.
SOURCE_VAR = "TPU_NB_SOURCE"
#: Environment variable (a glob) naming this package's wheel in an attached wheels dataset, and
#: its default: every dataset Kaggle mounts under /kaggle/input (course.setup.WHEELS_GLOB).
WHEELS_VAR, WHEELS_GLOB = "TPU_NB_WHEELS", "/kaggle/input/*/tpu_helpers-*.whl"
#: The Kaggle dataset of wheels for Internet off (course.setup.WHEELS_DATASET).
WHEELS_DATASET = "tpu-notebooks-wheels"
#: The longest setup cell the checker accepts (lines, comments and blanks included): 8 before
#: the Internet-off path (the wheels glob, its import, and the comment naming the dataset).
MAX_SETUP_LINES = 11


def setup_cell() -> str:
    """The setup cell every notebook starts with (identical in all of them).

    If ``tpu_helpers`` is not importable (Colab, Kaggle), one ``%pip install --no-deps`` of this
    repository's package: the toolkit, the course code and the data (``pyproject.toml``), and
    never torch or torch_xla. It installs from an attached wheels dataset if one is found
    (``$TPU_NB_WHEELS``, by default this package's wheel in any dataset under
    ``/kaggle/input/``: ``make kaggle-dataset``, for Kaggle with Internet off; a local wheel
    with ``--no-deps`` needs no index), else from ``$TPU_NB_SOURCE`` (or the ``SOURCE`` line,
    edited), which names anything pip installs from instead of :data:`REPO_URL`: a fork's git
    URL, a wheel file or URL (``make wheel``), or a writable folder holding a copy of the
    repository. Locally (the venv's editable install, or ``PYTHONPATH``) nothing is installed.
    Then ``course.setup.setup_notebook()`` keeps a supported torch/torch_xla pair or installs a
    matched one and the notebook packages the platform lacks (:func:`course.setup.plan_setup`),
    from the same wheels if attached; with neither Internet nor the wheels it says exactly what
    to attach. If pip fails here, its error is printed and the last line stops with ``No module
    named 'course'``; the comment above it (shown in the traceback) says what to do: Internet
    on, or the dataset to attach (README "Kaggle with Internet off").
    """
    return f'''{SETUP_MARKER}: this repository's package if missing, then what the platform lacks.
import glob
import importlib.util
import os

SOURCE = os.environ.get("{SOURCE_VAR}", "git+{REPO_URL}")
WHEELS = glob.glob(os.environ.get("{WHEELS_VAR}", "{WHEELS_GLOB}"))
if importlib.util.find_spec("tpu_helpers") is None:
    %pip install -q --no-deps {{(WHEELS + [SOURCE])[0]}}
# failed? Kaggle: Internet on, or Add Input > dataset {WHEELS_DATASET} (README: Internet off)
RUNTIME = importlib.import_module("course.setup").setup_notebook()'''


# --------------------------------------------------------------------------- checking


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _next_notebook(path: Path) -> str | None:
    """File name of the notebook after ``path`` in the course, or None for the last one."""
    later = sorted(p.name for p in path.parent.glob("[0-9][0-9]_*.ipynb") if p.name > path.name)
    return later[0] if later else None


def metadata_problems(meta: dict[str, Any]) -> list[str]:
    """What is missing from the metadata that makes Colab and Kaggle open on a TPU."""
    problems = []
    for key, want in NOTEBOOK_METADATA.items():
        have = meta.get(key)
        if isinstance(want, dict):
            have = have if isinstance(have, dict) else {}
            wrong = sorted(k for k, v in want.items() if have.get(k) != v)
            if wrong:
                problems.append(f"metadata.{key} lacks {', '.join(wrong)} as the template sets "
                                "them (Colab/Kaggle would not open a TPU; run `make template`)")
        elif have != want:
            problems.append(f"metadata.{key} is {have!r}, not {want!r} (run `make template`)")
    if "dockerImageVersionId" in (meta.get("kaggle") or {}):
        problems.append("metadata.kaggle.dockerImageVersionId pins a CPU/GPU image on Kaggle "
                        "(no TPU): remove it (run `make template`)")
    return problems


def course_problems(meta: dict[str, Any]) -> list[str]:
    """What is wrong with the notebook's :data:`COURSE_KEY` metadata (empty: it is fine)."""
    course = meta.get(COURSE_KEY)
    where = f"metadata.{COURSE_KEY}"
    if not isinstance(course, dict):
        return [f"{where} is missing: add {{\"teaches\": [...], \"devices\": \"...\", "
                f"\"budget_seconds\": {MAX_BUDGET_S}}} (notebooks/README.md)"]
    problems = []
    teaches = course.get("teaches")
    if not (isinstance(teaches, list) and teaches
            and all(isinstance(t, str) and t.strip() for t in teaches)):
        problems.append(f"{where}.teaches must be a non-empty list of short strings")
    else:
        long = [t for t in teaches if len(t) > MAX_TEACH_CHARS]
        if long:
            problems.append(f"{where}.teaches items over {MAX_TEACH_CHARS} characters: {long}")
    devices = course.get("devices")
    if not (isinstance(devices, str) and devices.strip().endswith(".")
            and 20 <= len(devices) <= MAX_DEVICES_CHARS):
        problems.append(f"{where}.devices must be one sentence (20-{MAX_DEVICES_CHARS} "
                        "characters, ending with '.') saying which devices it uses here and on "
                        "a TPU")
    budget = course.get("budget_seconds")
    if type(budget) is not int or not 0 < budget <= MAX_BUDGET_S:
        problems.append(f"{where}.budget_seconds must be an int from 1 to {MAX_BUDGET_S}, "
                        f"not {budget!r}")
    unknown = sorted(set(course) - {"teaches", "devices", "budget_seconds"})
    if unknown:
        problems.append(f"{where} has unknown keys {unknown}")
    return problems


def budget_seconds(path: str | Path) -> int:
    """The notebook's time budget from its metadata (:data:`MAX_BUDGET_S` if it has none)."""
    try:
        course = json.loads(Path(path).read_text(encoding="utf-8"))["metadata"][COURSE_KEY]
        budget = course["budget_seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return MAX_BUDGET_S
    return budget if type(budget) is int and 0 < budget <= MAX_BUDGET_S else MAX_BUDGET_S


def _head_problems(name: str, first: dict[str, Any]) -> list[str]:
    """Cell 1: title, both badges, the runtime line, 'What you will learn'."""
    head, problems = _source(first), []
    if first.get("cell_type") != "markdown" or not head.startswith("# "):
        problems.append("cell 1 must be markdown starting with a '# Title'")
    if f"]({colab_url(name)})" not in head or COLAB_BADGE not in head:
        problems.append(f"cell 1 lacks the Open in Colab badge for {name}")
    if f"]({kaggle_url(name)})" not in head or KAGGLE_BADGE not in head:
        problems.append(f"cell 1 lacks the Open in Kaggle badge for {name}")
    if RUNTIME_LINE not in head:
        problems.append("cell 1 lacks the line saying which menu picks a TPU (run `make template`)")
    if "what you will learn" not in head.lower():
        problems.append("cell 1 lacks a 'What you will learn' section")
    return problems


def _code_problems(code: list[dict[str, Any]]) -> list[str]:
    """The setup cell, the config cell, and at least one assert."""
    problems = []
    if not code or _source(code[0]) != setup_cell():
        problems.append("the first code cell is not the canonical setup cell (run `make template`)")
    if code and len(_source(code[0]).splitlines()) > MAX_SETUP_LINES:
        problems.append(f"the setup cell has {len(_source(code[0]).splitlines())} lines, more than "
                        f"{MAX_SETUP_LINES}: what it does belongs in course/setup.py")
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
    return problems


def _ending_problems(path: Path, cells: list[dict[str, Any]]) -> list[str]:
    """'What you learned', then 'How this notebook is checked'; each links to the next notebook
    (the last notebook back to the README)."""
    name, problems = path.name, []
    md = [_source(c) for c in cells if c.get("cell_type") == "markdown"]
    learned = [i for i, s in enumerate(md) if re.search(r"^#+ What you learned", s, re.M)]
    if not learned:
        problems.append("no '## What you learned' section")
    checked = [i for i, s in enumerate(md) if re.search(rf"^## {CHECKED_HEADING}\s*$", s, re.M)]
    if len(checked) != 1 or (learned and checked[0] < learned[-1]):
        problems.append(f"one '## {CHECKED_HEADING}' section must follow 'What you learned'")
    tail = "\n".join(md[learned[-1]:]) if learned else ""
    nxt = _next_notebook(path)
    if nxt and md and f"]({nxt})" not in md[-1]:
        problems.append(f"the last markdown cell must link to the next notebook ({nxt})")
    if nxt and f"]({nxt})" not in tail:
        problems.append(f"'What you learned' must end with a link to the next notebook ({nxt})")
    planned = re.search(rf"\]\({int(name[:2]) + 1:02d}_[a-z0-9_]+\.ipynb\)", tail) if _NAME.match(
        name) else None
    if not nxt and "](../README.md)" not in tail and not planned:
        problems.append("the last notebook must link back to ../README.md")
    return problems


def check_notebook(path: str | Path) -> list[str]:
    """Return the template problems of one notebook (an empty list means it conforms)."""
    path = Path(path)
    problems: list[str] = []
    if not _NAME.match(path.name):
        problems.append(f"name {path.name!r} is not NN_lowercase_words.ipynb")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"cannot read as notebook JSON: {exc}"]
    cells = nb.get("cells", [])
    if len(cells) < 5:
        return problems + [f"only {len(cells)} cells; the template needs at least 5"]
    problems += _head_problems(path.name, cells[0])
    problems += metadata_problems(nb.get("metadata", {}))
    problems += course_problems(nb.get("metadata", {}))
    problems += _code_problems([c for c in cells if c.get("cell_type") == "code"])
    problems += _ending_problems(path, cells)
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
    lines = [ln for ln in head.splitlines() if COLAB_BADGE not in ln and KAGGLE_BADGE not in ln
             and not ln.startswith(RUNTIME_PREFIX)]
    title_end = 1 if lines and lines[0].startswith("# ") else 0
    lines[title_end:title_end] = ["", badges(path.name), "", RUNTIME_LINE, ""]
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
    set_metadata(nb)
    return strip(nb)


def set_metadata(nb: dict[str, Any]) -> dict[str, Any]:
    """Write :data:`NOTEBOOK_METADATA` into the notebook (in place; other keys are kept)."""
    meta = nb.setdefault("metadata", {})
    for key, want in NOTEBOOK_METADATA.items():
        if isinstance(want, dict):
            have = meta.get(key) if isinstance(meta.get(key), dict) else {}
            have = {k: v for k, v in have.items() if k != "dockerImageVersionId"}
            meta[key] = {**have, **json.loads(json.dumps(want))}
        else:
            meta[key] = want
    return nb


def strip_on_save(folder: str | Path):
    """A Jupyter ``pre_save_hook`` stripping outputs of notebooks saved under ``folder``.

    Used by the repository's ``jupyter_server_config.py`` (``make lab``): every save, autosave
    included, writes the notebook as :func:`strip` leaves it; files elsewhere are untouched.
    """
    root = Path(folder).resolve()

    def hook(model: dict[str, Any], path: str, contents_manager: Any = None, **_: Any) -> None:
        if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
            return
        base = Path(getattr(contents_manager, "root_dir", None) or ".")
        full = (base / path.lstrip("/")).resolve()
        if root in full.parents:
            strip(model["content"])

    return hook


def _write(path: Path, nb: dict[str, Any]) -> None:
    tmp = path.with_suffix(".ipynb.tmp")
    tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def notebooks(folder: str | Path) -> list[Path]:
    """The course notebooks in ``folder``, in order."""
    return sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))


def _title(nb: dict[str, Any]) -> str:
    first = _source(nb["cells"][0]).splitlines()[0] if nb.get("cells") else ""
    return first.removeprefix("# ").strip()


def course_table(folder: str | Path) -> str:
    """The README's course table, one row per notebook, from each notebook's metadata."""
    folder = Path(folder)
    rows = ["| notebook | what it teaches | devices | budget |", "|---|---|---|---|"]
    for path in notebooks(folder):
        nb = json.loads(path.read_text(encoding="utf-8"))
        course = nb.get("metadata", {}).get(COURSE_KEY)
        link = f"[{_title(nb)}]({folder.name}/{path.name})"
        if not isinstance(course, dict) or course_problems(nb["metadata"]):
            rows.append(f"| {link} | (no valid {COURSE_KEY} metadata) | | |")
            continue
        teaches = "; ".join(t.replace("|", "\\|") for t in course["teaches"])
        devices = course["devices"].replace("|", "\\|")
        rows.append(f"| {link} | {teaches} | {devices} | {course['budget_seconds']} s |")
    return "\n".join(rows)


def readme_with_table(text: str, table: str) -> str:
    """``text`` with the block between :data:`README_START` and :data:`README_END` replaced."""
    if README_START not in text or README_END not in text:
        raise ValueError(f"no {README_START} ... {README_END} block")
    before, rest = text.split(README_START, 1)
    after = rest.split(README_END, 1)[1]
    return f"{before}{README_START}\n{table}\n{README_END}{after}"


def readme_table(text: str) -> str:
    """The course table committed in a README's block."""
    return text.split(README_START, 1)[1].split(README_END, 1)[0].strip()


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--strip", action="store_true")
    mode.add_argument("--readme", metavar="README.md",
                      help="rewrite the course table in this README from the notebooks' metadata")
    ap.add_argument("paths", nargs="*", default=["notebooks"],
                    help="notebook files, or folders of NN_*.ipynb notebooks")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.readme:
        folder = args.paths[0] if args.paths else "notebooks"
        readme = Path(args.readme)
        text = readme_with_table(readme.read_text(encoding="utf-8"), course_table(folder))
        readme.write_text(text, encoding="utf-8")
        missing = course_table(folder).count(f"(no valid {COURSE_KEY} metadata)")
        print(f"{readme}: course table from {len(notebooks(folder))} notebooks"
              + (f", {missing} without valid {COURSE_KEY} metadata" if missing else ""))
        return 1 if missing else 0
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
