"""The course's text rules (scripts/course_text.py): every TPU sentence labelled by where it comes
from, every cross-reference resolving, evidence only in each notebook's closing section. Each rule
runs on every notebook and the READMEs, and on small broken notebooks to show it can fail."""

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


def test_the_course_has_references_and_labelled_claims():
    """The rules are not vacuous: the course does refer across notebooks and label its claims."""
    refs = sum(len(ct.references(p)) for p in NOTEBOOKS + READMES)
    labelled = sum(1 for p in NOTEBOOKS for s in ct.tpu_sentences(p) if s.label)
    print(f"{refs} references, {labelled} labelled TPU sentences")
    assert refs >= 50 and labelled >= 50


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


def test_an_unlabelled_tpu_sentence_fails(tmp_path, monkeypatch):
    probs = _claims(tmp_path, "Matmuls on a TPU round float32 inputs to bfloat16.",
                    monkeypatch=monkeypatch)
    assert len(probs) == 1 and "unlabelled TPU sentence" in probs[0]


@pytest.mark.parametrize("label", [
    "[source: torch_xla v2.9.0 torch_xla/backends/__init__.py]",
    "[emulated: TPU-numerics lane]", "[expected]"])
def test_each_of_the_three_labels_passes(tmp_path, monkeypatch, label):
    assert _claims(tmp_path, f"Matmuls on a TPU round float32 inputs {label}. Next one.",
                   monkeypatch=monkeypatch) == []


@pytest.mark.parametrize("label", ["[source: trust me]", "[emulated: my laptop]"])
def test_a_label_that_names_nothing_fails(tmp_path, monkeypatch, label):
    probs = _claims(tmp_path, f"A TPU is fast {label}.", monkeypatch=monkeypatch)
    assert len(probs) == 1 and "names no" in probs[0]


def test_each_sentence_needs_its_own_label(tmp_path, monkeypatch):
    text = "A TPU rounds matmuls [expected]. A TPU also caches nothing.\n\n| row | TPU v5e-8 |"
    probs = _claims(tmp_path, text, monkeypatch=monkeypatch)
    assert len(probs) == 2 and "caches nothing" in probs[0] and "v5e-8" in probs[1]


def test_comments_are_sentences_too(tmp_path, monkeypatch):
    path = _nb(tmp_path, "99_probe.ipynb", [("code", "# Setup"), (
        "code", "x = 1  # on a TPU this is 8\n# A TPU v5e-8 has 8 processes [source: "
                "torch_xla v2.9.0 torch_xla/_internal/tpu.py]\ny = 2")])
    monkeypatch.setattr(ct, "NOT_CLAIMS_DIR", tmp_path)
    probs = ct.claim_problems(path)
    assert len(probs) == 1 and "this is 8" in probs[0]


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
    labelled = _nb(tmp_path, "99_c.ipynb", [("markdown", "Rounded [emulated: TPU-numerics lane].")])
    assert ct.evidence_problems(labelled) == []
    closing = _nb(tmp_path, "99_b.ipynb", [
        ("markdown", "Lesson."), ("markdown", "## How this notebook is checked\nThe lane.")])
    assert ct.evidence_problems(closing) == []
