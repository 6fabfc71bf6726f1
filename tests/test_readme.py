"""The README and its companion pages (CONTRIBUTING.md, GUIDE.md, benchmarks/README.md) list the
notebooks that are present: the course table links each one, the layout names their range, the
benchmarks' run-time table has a row per notebook, and the jax lane's notebook list is the
Makefile's. A notebook added or removed without its lists fails here.

The other checks on these files live beside what they check: the course table is generated
(tests/test_notebook_template.py), the units table's line counts (tests/test_copy_units.py), the
TPU run record block (tests/test_tpu_check.py), cross-references and anchors in every page
(tests/test_course_text.py), the install URL (tests/test_doctor_ci.py)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NUMBERS = [p.name[:2] for p in NOTEBOOKS]


def _text(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def test_the_readme_links_every_notebook_once():
    readme = _text("README.md")
    table = readme.split("<!-- course-table:start -->", 1)[1].split("<!-- course-table:end -->")[0]
    linked = re.findall(r"\]\(notebooks/(\d\d_[a-z0-9_]+\.ipynb)\)", table)
    assert linked == [p.name for p in NOTEBOOKS]


def test_the_layout_names_the_notebooks_present():
    layout = _text("CONTRIBUTING.md")
    ranges = re.findall(r"^notebooks/ +the course \((\d\d)-(\d\d)\)", layout, re.M)
    assert ranges == [(NUMBERS[0], NUMBERS[-1])], ranges
    assert NUMBERS == [f"{n:02d}" for n in range(len(NUMBERS))]  # no gap the range would hide


def test_the_run_time_table_has_a_row_per_notebook_and_its_total():
    text = _text("benchmarks/README.md").split("## Notebook run times", 1)[1]
    row = r"^\| \[(\d\d)\]\(\.\./notebooks/(\d\d_[a-z0-9_]+\.ipynb)\) \| (\d+) \|"
    rows = re.findall(row, text, re.M)
    assert [r[0] for r in rows] == NUMBERS, "one row per notebook present, in order"
    assert [r[1] for r in rows] == [p.name for p in NOTEBOOKS]
    (total,) = re.findall(r"^\| total \| \*\*(\d+)\*\* \|", text, re.M)
    assert int(total) == sum(int(r[2]) for r in rows)


def test_the_jax_notebook_lists_are_the_makefiles():
    make = _text("Makefile").split("JAX_NOTEBOOKS :=", 1)[1].split(")\n", 1)[0]
    jax = re.findall(r"\b(\d\d)_\w+\.ipynb", make)
    assert jax and set(jax) <= set(NUMBERS)
    forms = {", ".join(jax[:-1]) + " and " + jax[-1], ", ".join(jax)}
    found = []
    for name in ("README.md", "CONTRIBUTING.md", "GUIDE.md"):
        for m in re.finditer(r"\b02, 03, 04, 07(?:(?:,|\s+and|,\s+and)\s+\d\d\b)*", _text(name)):
            listed = " ".join(m.group(0).split())
            found.append(listed)
            assert listed in forms, f"{name}: {listed!r} is not the Makefile's {jax}"
    assert len(found) >= 3, found
