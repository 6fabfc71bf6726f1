"""The course's text, checked: TPU claims carry their label, references resolve, evidence
stays in each notebook's closing section.

Three rules of the course, each a function here and a test in ``tests/test_course_text.py``:

1. **Every sentence about a TPU says where it comes from.** A sentence (markdown sentence, list
   item, table row, or code comment) that mentions a TPU carries one of three labels:
   ``[source: <release> <file or document>]`` (read from source), ``[emulated: <lane>]``
   (measured here under an emulation: XLA:CPU, the TPU-numerics lane, the jax lane, virtual
   devices, gloo processes) or ``[expected]`` (expected, not yet run on a TPU). Sentences that
   mention a TPU but claim nothing (instructions, questions) are listed verbatim, by their
   start, in ``tests/data/tpu_not_claims/<notebook stem>.txt``.
2. **Every cross-reference resolves**: ``notebook NN``, ``notebook NN, section K``, a bare
   ``section K`` (this notebook), links to ``NN_name.ipynb#anchor``, ``#anchor``,
   ``../README.md#anchor`` and relative files; in the READMEs too.
3. **Lessons first, evidence behind**: mentions of ``tests/``, a "lane" or an "emulation gap"
   appear only in the closing ``## How this notebook is checked`` section.

Command line::

    python scripts/course_text.py claims notebooks/09_*.ipynb   # each TPU sentence, labelled or not
    python scripts/course_text.py counts notebooks              # labels per notebook (a table)
    python scripts/course_text.py refs notebooks README.md      # every reference, resolved or not
    python scripts/course_text.py check notebooks README.md     # exit 1 on any problem
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_CLAIMS_DIR = ROOT / "tests" / "data" / "tpu_not_claims"
CHECKED_HEADING = "How this notebook is checked"

#: Words that make a sentence one "about a TPU".
TPU_WORDS = re.compile(r"\bTPUs?\b|\bv5e\b|\bv6e\b|\bv[234]-8\b|\blibtpu\b|\bPallas\b|\bMXU\b")
LABEL = re.compile(r"\[(source|emulated|expected)(?::\s*([^\]]*))?\]")
#: What an ``[emulated: ...]`` label must name.
LANES = re.compile(r"XLA:CPU|TPU-numerics|jax lane|virtual devices?|gloo", re.I)
#: What a ``[source: ...]`` label must name: a release/version, a file, or a document.
SOURCE_WHERE = re.compile(r"\d+\.\d+|v\d|\.(py|md|cpp|h|cc|txt|toml)\b|guide|docs?\b|README|"
                          r"Dockerfile|freeze|issue|PR \d|RFC|tutorial", re.I)
EVIDENCE_WORDS = re.compile(r"tests/|\blanes?\b|emulation gap", re.I)


@dataclass(frozen=True)
class Sentence:
    """One unit of text: where it is, what it says, and its label (None when unlabelled)."""

    notebook: str
    cell: int          # 1-based cell number
    where: str         # "markdown" or "comment"
    text: str
    label: str | None  # "source" | "emulated" | "expected" | None
    problem: str = ""  # a label whose content names no source/lane


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _src(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _markdown_units(text: str) -> list[str]:
    """Sentences, list items and table rows of a markdown cell (no headings, code, badges)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    units: list[str] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            units.extend(_sentences(" ".join(para)))
            para.clear()

    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#") or s.startswith("[![") or s.startswith("**Runtime:**"):
            flush()
        elif s.startswith("|"):
            flush()
            if not re.fullmatch(r"[|:\-\s]+", s):
                units.append(s)
        elif re.match(r"([-*+]|\d+\.)\s", s) or s.startswith(">"):
            flush()
            para.append(s)
        else:
            para.append(s)
    flush()
    return units


def _sentences(paragraph: str) -> list[str]:
    """Split at '. ' before a capital, a backtick or a bracket; a lone label joins the previous."""
    masked = re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace(" ", "\0"), paragraph)
    parts = [p.replace("\0", " ") for p in re.split(r"(?<=[.!?])\s+(?=[A-Z`*_(\"\[])", masked)]
    out: list[str] = []
    for p in parts:
        if out and LABEL.fullmatch(p.strip().rstrip(".")):
            out[-1] += " " + p
        else:
            out.append(p)
    return out


def _comment_units(code: str) -> list[str]:
    """Comments of a code cell: a run of full-line comments is one paragraph."""
    units: list[str] = []
    block: list[str] = []
    for line in code.splitlines():
        m = re.match(r"\s*#(?!@save)\s?(.*)$", line)
        if m:
            block.append(m.group(1))
            continue
        if block:
            units.extend(_sentences(" ".join(block)))
            block = []
        tail = re.search(r"\s#\s(.*)$", line)
        if tail and line.count('"') % 2 == 0 and line.count("'") % 2 == 0:
            units.append(tail.group(1))
    if block:
        units.extend(_sentences(" ".join(block)))
    return units


def label_of(text: str) -> tuple[str | None, str]:
    """The label a unit carries (or None) and what is wrong with it ('' if nothing)."""
    m = LABEL.search(text)
    if not m:
        return None, ""
    kind, what = m.group(1), (m.group(2) or "").strip()
    if kind == "source" and not SOURCE_WHERE.search(what):
        return kind, f"[source: {what}] names no release, file or document"
    if kind == "emulated" and not LANES.search(what):
        return kind, f"[emulated: {what}] names no lane (XLA:CPU, TPU-numerics lane, jax lane, ...)"
    return kind, ""


def tpu_sentences(path: str | Path) -> list[Sentence]:
    """Every unit of a notebook that mentions a TPU (the setup cell is the template's)."""
    path = Path(path)
    out: list[Sentence] = []
    code_seen = 0
    for i, cell in enumerate(_cells(path), 1):
        src = _src(cell)
        if cell.get("cell_type") == "markdown":
            units, where = _markdown_units(src), "markdown"
        elif cell.get("cell_type") == "code":
            code_seen += 1
            if code_seen == 1:
                continue  # the canonical setup cell, rendered by scripts/notebook_template.py
            units, where = _comment_units(src), "comment"
        else:
            continue
        for u in units:
            if TPU_WORDS.search(LABEL.sub("", u)):
                kind, problem = label_of(u)
                out.append(Sentence(path.name, i, where, u.strip(), kind, problem))
    return out


def not_claims(path: str | Path) -> list[str]:
    """The listed starts of sentences that mention a TPU but claim nothing."""
    f = NOT_CLAIMS_DIR / f"{Path(path).stem}.txt"
    if not f.exists():
        return []
    return [ln.strip() for ln in f.read_text(encoding="utf-8").splitlines()
            if ln.strip() and not ln.startswith("#")]


def claim_problems(path: str | Path) -> list[str]:
    """Unlabelled TPU sentences, labels naming nothing, and stale not-a-claim entries."""
    listed = not_claims(path)
    used: set[str] = set()
    problems = []
    for s in tpu_sentences(path):
        start = next((n for n in listed if s.text.startswith(n)), None)
        if s.problem:
            problems.append(f"{s.notebook} cell {s.cell}: {s.problem}: {s.text[:120]!r}")
        elif s.label is None and start is None:
            problems.append(f"{s.notebook} cell {s.cell} ({s.where}): unlabelled TPU sentence: "
                            f"{s.text[:160]!r}")
        if start is not None:
            used.add(start)
    problems += [f"{Path(path).name}: not-a-claim entry matches no sentence: {n!r}"
                 for n in listed if n not in used]
    return problems


def counts(path: str | Path) -> dict[str, int]:
    """Labels per kind, and the listed non-claims, for one notebook."""
    c = {"source": 0, "emulated": 0, "expected": 0, "not a claim": 0, "unlabelled": 0}
    listed = not_claims(path)
    for s in tpu_sentences(path):
        if s.label:
            c[s.label] += 1
        elif any(s.text.startswith(n) for n in listed):
            c["not a claim"] += 1
        else:
            c["unlabelled"] += 1
    return c


# ----------------------------------------------------------------------- references


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"`|\*\*?|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def headings_of(path: Path) -> list[str]:
    if path.suffix == ".ipynb":
        text = "\n".join(_src(c) for c in _cells(path) if c.get("cell_type") == "markdown")
    else:
        text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*$", text, re.M)]


def _anchors(path: Path) -> set[str]:
    hs = headings_of(path)
    return {slug(h) for h in hs} | {h.strip().replace(" ", "-") for h in hs}


def _sections(path: Path) -> set[int]:
    return {int(m.group(1)) for h in headings_of(path) if (m := re.match(r"(\d+)\.", h))}


def _notebook(folder: Path, nn: str) -> Path | None:
    found = sorted(folder.glob(f"{nn}_*.ipynb"))
    return found[0] if found else None


NB_SECTION = re.compile(r"\bnotebook (\d\d)(?:,|'s)? (?:section|part) (\d+)", re.I)
LINK_SECTION = re.compile(
    r"\]\((?:\.\./notebooks/)?(\d\d)_[a-z0-9_]+\.ipynb\),? (?:section|part) (\d+)", re.I)
SECTION_OF_NB = re.compile(r"\b(?:section|part) (\d+) of notebook (\d\d)", re.I)
NB = re.compile(r"\bnotebooks? (\d\d)(?:\s*(?:-|–|to|and|,)\s*(\d\d))?", re.I)
BARE_SECTION = re.compile(r"(?<!notebook \d\d, )(?<!notebook \d\d )\b(?:section|part) (\d+)\b"
                          r"(?! of (?!notebook))", re.I)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _text_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        return "\n".join(_src(c) for c in _cells(path) if c.get("cell_type") == "markdown")
    return path.read_text(encoding="utf-8")


def references(path: str | Path) -> list[tuple[str, str]]:
    """Every reference in a notebook's markdown (or a README): (reference, problem or '')."""
    path = Path(path).resolve()
    nb_dir = ROOT / "notebooks"
    text = re.sub(r"```.*?```", "", _text_of(path), flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code quotes names, it does not refer
    out: list[tuple[str, str]] = []
    consumed: list[tuple[int, int]] = []
    for pattern, nn_group, k_group in ((NB_SECTION, 1, 2), (LINK_SECTION, 1, 2),
                                       (SECTION_OF_NB, 2, 1)):
        for m in pattern.finditer(text):
            nn, k = m.group(nn_group), int(m.group(k_group))
            nb = _notebook(nb_dir, nn)
            out.append((m.group(0), "" if nb and k in _sections(nb) else
                        f"notebook {nn} has no section {k}" if nb else "no such notebook"))
            consumed.append(m.span())
    for m in NB.finditer(text):
        for nn in filter(None, m.groups()):
            out.append((f"notebook {nn}", "" if _notebook(nb_dir, nn) else "no such notebook"))
    if path.suffix == ".ipynb":
        own = _sections(path)
        for m in BARE_SECTION.finditer(text):
            if any(a <= m.start() < b for a, b in consumed):
                continue
            k = int(m.group(1))
            out.append((m.group(0), "" if k in own else f"this notebook has no section {k}"))
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # external URL
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append((target, f"{file} does not exist"))
        elif anchor and dest.suffix in (".ipynb", ".md") and anchor not in _anchors(dest):
            out.append((target, f"no heading with anchor #{anchor} in {dest.name}"))
        else:
            out.append((target, ""))
    return out


def evidence_problems(path: str | Path) -> list[str]:
    """Markdown outside the closing section that talks of tests/, lanes or emulation gaps."""
    path = Path(path)
    problems = []
    in_checked = False
    for i, cell in enumerate(_cells(path), 1):
        if cell.get("cell_type") != "markdown":
            continue
        src = LABEL.sub("", _src(cell))  # a label names its lane; that is not evidence talk
        if re.search(rf"^#+\s+{CHECKED_HEADING}", src, re.M):
            in_checked = True
        if not in_checked and (m := EVIDENCE_WORDS.search(src)):
            line = next(ln for ln in src.splitlines() if m.group(0) in ln)
            problems.append(f"{path.name} cell {i}: {m.group(0)!r} outside '## {CHECKED_HEADING}'"
                            f": {line.strip()[:120]!r}")
    return problems


def _paths(args: list[str]) -> list[Path]:
    out: list[Path] = []
    for a in args:
        p = Path(a)
        out += sorted(p.glob("[0-9][0-9]_*.ipynb")) if p.is_dir() else [p]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("claims", "counts", "refs", "check"):
        print(__doc__)
        return 2
    cmd, paths = argv[0], _paths(argv[1:])
    bad = 0
    if cmd == "counts":
        keys = list(counts(paths[0]))
        print("| notebook | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for p in paths:
            c = counts(p)
            print(f"| {p.stem} | " + " | ".join(str(c[k]) for k in keys) + " |")
        return 0
    for p in paths:
        if cmd == "claims" and p.suffix == ".ipynb":
            for s in tpu_sentences(p):
                print(f"{s.cell:3d} {s.label or '-':9s} {s.text[:150]}")
        elif cmd == "refs":
            for ref, problem in references(p):
                print(f"{p}: {ref!r} {'-> ' + problem if problem else 'ok'}")
        elif cmd == "check":
            problems = [f"{p}: {r!r}: {why}" for r, why in references(p) if why]
            if p.suffix == ".ipynb":
                problems += claim_problems(p) + evidence_problems(p)
            for line in problems:
                print(line)
            bad += len(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
