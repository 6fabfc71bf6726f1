"""The course's text, checked: TPU claims say where they come from, references resolve,
evidence stays in each notebook's closing section.

Three rules of the course, each a function here and a test in ``tests/test_course_text.py``:

1. **Every sentence about a TPU says where it comes from**, in one of two ways:
   - read from source: a numbered marker, ``[[N]](#sources)`` in markdown (``[N]`` in a code
     comment), whose entry ``N. <release, file or document>`` is in the notebook's (or page's)
     ``### Sources`` list, in the closing section. Each entry is cited, numbered 1, 2, ... once
     per source, and names a release, file or document outside this repository (the course's
     own code is not evidence about a TPU);
   - measured here under an emulation, or expected on a TPU: one callout for the section (the
     text from its ``##`` heading to the next), a line ``> **On a TPU:** ...`` that says
     "expected" or names the emulation (XLA:CPU, TPU-numerics, jax, virtual devices, gloo).
   Sentences that mention a TPU but claim nothing (instructions, questions) are listed verbatim,
   by their start, in ``tests/data/tpu_not_claims/<notebook stem>.txt``. The old inline labels
   (``[source: ...]``, ``[emulated: ...]``, ``[expected]``) are refused everywhere.
2. **Every cross-reference resolves**: ``notebook NN``, ``notebook NN, section K``, a bare
   ``section K`` (this notebook), links to ``NN_name.ipynb#anchor``, ``#anchor``,
   ``../README.md#anchor`` and relative files; in the READMEs too, and their markers.
3. **Lessons first, evidence behind**: mentions of ``tests/``, a "lane" or an "emulation gap"
   appear only in the closing ``## How this notebook is checked`` section.

Command line::

    python scripts/course_text.py claims notebooks/09_*.ipynb   # each TPU sentence, covered or not
    python scripts/course_text.py counts notebooks              # markers and callouts per notebook
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
#: The inline labels of old, refused: a marker or the section's callout instead.
OLD_LABEL = re.compile(r"\[(source|emulated|expected)(?::\s*([^\]]*))?\]")
MARKER = re.compile(r"\[\[(\d+)\]\]\(#sources\)")  #: in markdown
COMMENT_MARKER = re.compile(r"(?<!\S)\[(\d+)\]")  #: in a code comment (not x[0])
CALLOUT = re.compile(r"^>\s*\*\*On a TPU:\*\*\s*(.*)$", re.M)
SOURCES_HEADING = re.compile(r"^#{2,3}\s+Sources\s*$", re.M)
ENTRY = re.compile(r"^(\d+)\.\s+(.+)$")
#: What a callout must name: "expected", or the emulation it was measured under.
LANES = re.compile(r"XLA:CPU|TPU-numerics|\bjax\b|virtual devices?|gloo", re.I)
#: The course's own files: not evidence about a TPU.
SELF = re.compile(r"^`?(tpu_helpers|course|tests|scripts|benchmarks|notebooks|examples)/", re.I)
#: What a Sources entry must name: a release/version, a file, or a document.
SOURCE_WHERE = re.compile(r"\d+\.\d+|v\d|\.(py|md|cpp|h|cc|txt|toml|in|json|yaml)\b|guide|"
                          r"docs?\b|README|Dockerfile|freeze|issue|PR \d|RFC|tutorial", re.I)
EVIDENCE_WORDS = re.compile(r"tests/|\blanes?\b|emulation gap", re.I)


@dataclass(frozen=True)
class Sentence:
    """One unit of text: where it is, what it says, and its label (None when unlabelled)."""

    notebook: str
    cell: int          # 1-based cell number
    where: str         # "markdown" or "comment"
    text: str
    label: str | None  # "marker" | "callout" (its section's) | None
    problem: str = ""  # an old-style label
    markers: tuple[int, ...] = ()


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
        if out and (OLD_LABEL.fullmatch(p.strip().rstrip(".")) or re.fullmatch(
                r"(\[\[\d+\]\]\(#sources\))+", p.strip().rstrip("."))):
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


def label_of(text: str, comment: bool = False) -> tuple[str | None, str, tuple[int, ...]]:
    """The marker a unit carries (or None), what is wrong with it ('' if nothing), its numbers."""
    if m := OLD_LABEL.search(text):
        return None, (f"old-style label {m.group(0)[:60]!r}: a numbered marker [[N]](#sources) "
                      "or the section's '> **On a TPU:**' callout instead"), ()
    nums = tuple(int(n) for n in (COMMENT_MARKER if comment else MARKER).findall(text))
    return ("marker" if nums else None), "", nums


def sources(text: str) -> dict[int, str]:
    """The numbered entries of the ``Sources`` list in a notebook's or page's markdown."""
    m = SOURCES_HEADING.search(text)
    if not m:
        return {}
    out: dict[int, str] = {}
    for line in text[m.end():].splitlines():
        if re.match(r"^#{1,3}\s", line):
            break
        if e := ENTRY.match(line.strip()):
            out[int(e.group(1))] = e.group(2).strip()
    return out


def _markdown_of(path: Path) -> str:
    return "\n".join(_src(c) for c in _cells(path) if c.get("cell_type") == "markdown")


def tpu_sentences(path: str | Path) -> list[Sentence]:
    """Every unit of a notebook's lessons that mentions a TPU (not the setup cell, the template's;
    not the closing section, which says where each claim was checked), with its marker, or its
    section's callout."""
    path = Path(path)
    out: list[Sentence] = []
    code_seen, section, covered = 0, 0, set()
    for cell in _cells(path):
        src = _src(cell)
        if cell.get("cell_type") == "markdown":
            for line in src.splitlines():  # callouts count from the cell of their section
                section += bool(re.match(r"^##\s", line))
                if (c := CALLOUT.match(line)) and ("expected" in c.group(1).lower()
                                                   or LANES.search(c.group(1))):
                    covered.add(section)
    code_seen = section = 0
    for i, cell in enumerate(_cells(path), 1):
        src = _src(cell)
        if closing := re.search(rf"^#+\s+{CHECKED_HEADING}", src, re.M):
            src = src[:closing.start()]  # the closing section is the evidence: not claims
        if cell.get("cell_type") == "markdown":
            units, where = [], "markdown"
            for chunk in re.split(r"(?m)^(?=##\s)", src):  # a cell may open a section midway
                section += bool(re.match(r"##\s", chunk))
                units += [(u, section) for u in _markdown_units(CALLOUT.sub("", chunk))]
        elif cell.get("cell_type") == "code":
            code_seen += 1
            if code_seen == 1:
                continue  # the canonical setup cell, rendered by scripts/notebook_template.py
            units, where = [(u, section) for u in _comment_units(src)], "comment"
        else:
            continue
        for u, sec in units:
            bare = MARKER.sub("", OLD_LABEL.sub("", u))
            if TPU_WORDS.search(bare if where == "markdown" else COMMENT_MARKER.sub("", bare)):
                kind, problem, nums = label_of(u, comment=where == "comment")
                kind = kind or ("callout" if sec in covered and not problem else None)
                out.append(Sentence(path.name, i, where, u.strip(), kind, problem, nums))
        if closing:
            break
    return out


def marker_problems(path: str | Path) -> list[str]:
    """Markers without an entry, entries never cited, numbering, entries naming nothing or the
    course's own code, old-style labels (notebooks: markdown and comments; pages: the text), and
    callouts that name neither "expected" nor an emulation."""
    path = Path(path)
    if path.suffix == ".ipynb":
        text = _markdown_of(path)
        comments = "\n".join(u for c in _cells(path) if c.get("cell_type") == "code"
                             for u in _comment_units(_src(c)))
    else:
        text, comments = path.read_text(encoding="utf-8"), ""
    body = re.sub(r"```.*?```", "", text, flags=re.S)
    cited = [int(n) for n in MARKER.findall(body)] + [int(n) for n in
                                                      COMMENT_MARKER.findall(comments)]
    entries, name, problems = sources(body), path.name, []
    problems += [f"{name}: marker [{n}] has no entry in the Sources list" for n in
                 sorted(set(cited) - set(entries))]
    problems += [f"{name}: Sources entry {n} is never cited" for n in sorted(set(entries) -
                                                                            set(cited))]
    if list(entries) != list(range(1, len(entries) + 1)):
        problems.append(f"{name}: Sources entries are not numbered 1..{len(entries)} in order")
    if len(set(entries.values())) != len(entries):
        problems.append(f"{name}: a source is listed twice")
    for n, e in entries.items():
        if SELF.search(e):
            problems.append(f"{name}: Sources entry {n} cites the course's own code: {e!r}")
        elif not SOURCE_WHERE.search(e):
            problems.append(f"{name}: Sources entry {n} names no release, file or document: {e!r}")
    for m in OLD_LABEL.finditer(body + "\n" + comments):
        problems.append(f"{name}: old-style label {m.group(0)[:60]!r}")
    for c in CALLOUT.finditer(body):
        if "expected" not in c.group(1).lower() and not LANES.search(c.group(1)):
            problems.append(f"{name}: a callout names neither 'expected' nor an emulation: "
                            f"{c.group(0)[:100]!r}")
    return problems


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
            problems.append(f"{s.notebook} cell {s.cell} ({s.where}): TPU sentence without a "
                            f"marker or its section's callout: {s.text[:160]!r}")
        if start is not None:
            used.add(start)
    problems += [f"{Path(path).name}: not-a-claim entry matches no sentence: {n!r}"
                 for n in listed if n not in used]
    return problems


def counts(path: str | Path) -> dict[str, int]:
    """TPU sentences per kind (a marker, its section's callout), the listed non-claims, and the
    unsourced, for one notebook; and its Sources entries and callouts."""
    c = {"marker": 0, "callout": 0, "not a claim": 0, "unlabelled": 0,
         "sources": len(sources(_markdown_of(Path(path)))),
         "callouts": len(CALLOUT.findall(_markdown_of(Path(path))))}
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
        src = CALLOUT.sub("", _src(cell))  # a callout names its emulation: not evidence talk
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
            problems += marker_problems(p)
            if p.suffix == ".ipynb":
                problems += claim_problems(p) + evidence_problems(p)
            for line in problems:
                print(line)
            bad += len(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
