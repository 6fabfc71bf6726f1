"""The course's text rules (scripts/course_text.py): every TPU sentence says where it comes from
(a numbered marker and its Sources entry, or its section's callout), every cross-reference
resolving, evidence only in each notebook's closing section. Each rule runs on every notebook and
the READMEs, and on small broken notebooks to show it can fail."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import course_text as ct  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
READMES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "GUIDE.md",
           ROOT / "benchmarks" / "README.md", ROOT / "notebooks" / "README.md"]
pytestmark = pytest.mark.one_line


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_tpu_sentence_says_where_it_comes_from(nb):
    problems = ct.claim_problems(nb)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", NOTEBOOKS + READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cross_reference_resolves(doc):
    refs = ct.references(doc)
    bad = [f"{ref!r}: {why}" for ref, why in refs if why]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_evidence_stays_in_the_closing_section(nb):
    problems = ct.evidence_problems(nb)
    assert not problems, "\n".join(problems)


def test_the_course_has_references_and_sourced_claims():
    """The rules are not vacuous: the course does refer across notebooks, cite its sources and
    say, per section, what was measured here or is expected on a TPU."""
    refs = sum(len(ct.references(p)) for p in NOTEBOOKS + READMES)
    kinds = [s.label for p in NOTEBOOKS for s in ct.tpu_sentences(p)]
    print(f"{refs} references, {kinds.count('marker')} TPU sentences with a marker, "
          f"{kinds.count('callout')} under their section's callout")
    assert refs >= 50 and kinds.count("marker") >= 50 and kinds.count("callout") >= 30


@pytest.mark.parametrize("doc", NOTEBOOKS + READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_marker_has_its_source_and_no_old_labels_remain(doc):
    problems = ct.marker_problems(doc)
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------- the checker can fail


def _nb(tmp_path: Path, name: str, cells: list[tuple[str, str]]) -> Path:
    nb = {"cells": [{"cell_type": t, "metadata": {}, "source": s,
                     **({"outputs": [], "execution_count": None} if t == "code" else {})}
                    for t, s in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / name
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def _claims(tmp_path, text, not_claims=None, monkeypatch=None):
    path = _nb(tmp_path, "99_probe.ipynb", [("markdown", "# 99 · Probe"),
                                             ("code", "# Setup (the template's)"),
                                             ("markdown", text)])
    d = tmp_path / "not_claims"
    d.mkdir(exist_ok=True)
    (d / "99_probe.txt").write_text("\n".join(not_claims or []), encoding="utf-8")
    monkeypatch.setattr(ct, "NOT_CLAIMS_DIR", d)
    return ct.claim_problems(path)


SOURCES = ("## How this notebook is checked\n\n### Sources\n\n"
           "1. torch_xla v2.9.0 torch_xla/backends/__init__.py\n")


def test_an_unsourced_tpu_sentence_fails(tmp_path, monkeypatch):
    probs = _claims(tmp_path, "Matmuls on a TPU round float32 inputs to bfloat16.",
                    monkeypatch=monkeypatch)
    assert len(probs) == 1 and "without a marker or its section's callout" in probs[0]


@pytest.mark.parametrize("text", [
    "Matmuls on a TPU round float32 inputs [[1]](#sources). Next one.",
    "## 1. Rounding\n\nMatmuls on a TPU round float32 inputs.\n\n"
    "> **On a TPU:** not yet run there; measured here on XLA:CPU with TPU-numerics emulation.",
    "## 1. Rounding\n\n> **On a TPU:** expected, not yet run there.\n\nA TPU rounds matmuls."])
def test_a_marker_or_the_sections_callout_passes(tmp_path, monkeypatch, text):
    assert _claims(tmp_path, text, monkeypatch=monkeypatch) == []


def test_a_callout_covers_its_own_section_only(tmp_path, monkeypatch):
    text = ("## 1. One\n\n> **On a TPU:** expected, not yet run there.\n\nA TPU rounds.\n\n"
            "## 2. Two\n\nA TPU also caches nothing.")
    probs = _claims(tmp_path, text, monkeypatch=monkeypatch)
    assert len(probs) == 1 and "caches nothing" in probs[0]


def test_a_callout_that_names_nothing_fails(tmp_path):
    path = _nb(tmp_path, "99_probe.ipynb", [("markdown", "## 1. One\n\n> **On a TPU:** trust me.")])
    probs = ct.marker_problems(path)
    assert len(probs) == 1 and "names neither" in probs[0]


@pytest.mark.parametrize("label", ["[source: torch_xla v2.9.0 torch_xla/_internal/tpu.py]",
                                   "[emulated: TPU-numerics lane]", "[expected]"])
def test_an_old_style_label_fails(tmp_path, monkeypatch, label):
    probs = _claims(tmp_path, f"Matmuls on a TPU round float32 inputs {label}.",
                    monkeypatch=monkeypatch)
    assert len(probs) == 1 and "old-style label" in probs[0]


@pytest.mark.parametrize("body,sources,problem", [
    ("A TPU rounds [[2]](#sources).", "1. torch_xla v2.9.0 a.py", "marker [2] has no entry"),
    ("A TPU rounds [[1]](#sources).", "1. torch_xla v2.9.0 a.py\n2. torch 2.9 b.py", "never cited"),
    ("A TPU rounds [[1]](#sources).", "1. trust me", "names no release"),
    ("A TPU rounds [[1]](#sources).", "1. tpu_helpers/env.py", "the course's own code"),
    ("A TPU [[1]](#sources) rounds [[2]](#sources).", "2. torch 2.9 b.py\n1. torch_xla v2.9.0 a.py",
     "not numbered"),
    ("A TPU [[1]](#sources) rounds [[2]](#sources).", "1. torch 2.9 b.py\n2. torch 2.9 b.py",
     "listed twice")])
def test_sources_lists_fail_when_wrong(tmp_path, body, sources, problem):
    path = _nb(tmp_path, "99_probe.ipynb", [("markdown", body), (
        "markdown", f"## How this notebook is checked\n\n### Sources\n\n{sources}\n")])
    probs = ct.marker_problems(path)
    assert any(problem in p for p in probs), probs


def test_each_sentence_needs_its_own_marker(tmp_path, monkeypatch):
    text = ("A TPU rounds matmuls [[1]](#sources). A TPU also caches nothing.\n\n"
            "| row | TPU v5e-8 |\n\n" + SOURCES)
    probs = _claims(tmp_path, text, monkeypatch=monkeypatch)
    assert len(probs) == 2 and "caches nothing" in probs[0] and "v5e-8" in probs[1]


def test_comments_are_sentences_too(tmp_path, monkeypatch):
    path = _nb(tmp_path, "99_probe.ipynb", [("code", "# Setup"), (
        "code", "x = 1  # on a TPU this is 8\n# A TPU v5e-8 has 8 processes [1]\ny = x[0]"),
        ("markdown", SOURCES)])
    monkeypatch.setattr(ct, "NOT_CLAIMS_DIR", tmp_path)
    probs = ct.claim_problems(path)
    assert len(probs) == 1 and "this is 8" in probs[0]
    assert ct.marker_problems(path) == []  # x[0] is code, not a marker


def test_the_closing_section_is_the_evidence_not_a_claim(tmp_path, monkeypatch):
    text = "Lesson.\n\n## How this notebook is checked\n\n- Not yet run on a TPU: the speed."
    assert _claims(tmp_path, text, monkeypatch=monkeypatch) == []


def test_listed_non_claims_pass_and_stale_entries_fail(tmp_path, monkeypatch):
    text = "Open this notebook on a TPU runtime."
    assert _claims(tmp_path, text, ["Open this notebook on a TPU"], monkeypatch) == []
    probs = _claims(tmp_path, text, ["Open this notebook on a TPU", "Gone sentence about"],
                    monkeypatch)
    assert len(probs) == 1 and "matches no sentence" in probs[0]


def test_broken_references_fail(tmp_path):
    path = _nb(tmp_path, "99_probe.ipynb", [("markdown", "# 99 · Probe\n## 1. One\n"), (
        "markdown", "See notebook 42, notebook 03, section 99, section 7, "
                    "[x](03_multicore_training.ipynb#no-such-heading), [y](#1-one) and "
                    "[z](missing.md).")])
    bad = {ref: why for ref, why in ct.references(path) if why}
    assert set(bad) == {"notebook 42", "notebook 03, section 99", "section 7",
                        "03_multicore_training.ipynb#no-such-heading", "missing.md"}, bad


def test_evidence_in_the_body_fails_and_in_the_closing_section_passes(tmp_path):
    body = _nb(tmp_path, "99_a.ipynb", [("markdown", "The lane checks this (tests/test_x.py).")])
    assert len(ct.evidence_problems(body)) == 1
    callout = _nb(tmp_path, "99_c.ipynb", [
        ("markdown", "Rounded.\n\n> **On a TPU:** not yet run there; measured here on XLA:CPU.")])
    assert ct.evidence_problems(callout) == []
    closing = _nb(tmp_path, "99_b.ipynb", [
        ("markdown", "Lesson."), ("markdown", "## How this notebook is checked\nThe lane.")])
    assert ct.evidence_problems(closing) == []
