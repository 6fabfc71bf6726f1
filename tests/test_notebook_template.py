"""Every notebook follows the template; a notebook that breaks it is caught."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tpu_helpers import notebook_template as tpl

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = tpl.notebooks(REPO / "notebooks")
COURSE = ["00_environment", "01_dataset_setup", "02_parallel_loader", "03_multicore_training",
          "04_prediction_gathering", "05_performance_debugging", "06_lightning_on_tpu",
          "07_model_sharding_spmd", "08_myths_and_facts"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found"
    assert NOTEBOOKS[0].name == "00_environment.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_follows_template(path: Path):
    assert tpl.check_notebook(path) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_part_of_the_course(path: Path):
    assert path.stem in COURSE, f"{path.name} is not in the course list (README, this test)"


def test_repo_url_lives_in_one_place():
    """Badges and setup cells are rendered from REPO_SLUG; no other copy of the URL exists."""
    assert tpl.setup_cell().count(tpl.REPO_URL) == 1
    for path in NOTEBOOKS:
        text = path.read_text()
        assert text.count(tpl.REPO_SLUG) == 3, f"{path.name}: two badges + the setup cell"
    others = [p for p in REPO.rglob("*") if p.is_file() and p.suffix in (".py", ".toml", ".cfg")
              and ".venv" not in p.parts and p.name != "notebook_template.py"
              and tpl.REPO_SLUG in p.read_text(errors="ignore")]
    assert others == [], f"the repository URL is repeated in {others}"


# ---------------------------------------------------------------- broken notebooks are caught


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A conforming notebook (a copy of 00) in a folder of its own."""
    dst = tmp_path / "00_environment.ipynb"
    shutil.copy(REPO / "notebooks" / "00_environment.ipynb", dst)
    assert tpl.check_notebook(dst) == []
    return dst


def _edit(path: Path, fn) -> list[str]:
    nb = json.loads(path.read_text())
    fn(nb)
    path.write_text(json.dumps(nb))
    return tpl.check_notebook(path)


def _src(cell) -> str:
    return "".join(cell["source"])


def test_missing_colab_badge_is_caught(good):
    def drop(nb):
        nb["cells"][0]["source"] = [ln for ln in nb["cells"][0]["source"] if "colab" not in ln]
    assert any("Colab badge" in p for p in _edit(good, drop))


def test_missing_kaggle_badge_is_caught(good):
    def drop(nb):
        nb["cells"][0]["source"] = [ln.replace(tpl.KAGGLE_BADGE, "x.svg")
                                    for ln in nb["cells"][0]["source"]]
    assert any("Kaggle badge" in p for p in _edit(good, drop))


def test_edited_setup_cell_is_caught(good):
    def edit(nb):
        nb["cells"][1]["source"].append("\nprint('hi')")
    assert any("canonical setup cell" in p for p in _edit(good, edit))


def test_config_cell_without_environment_is_caught(good):
    def edit(nb):
        nb["cells"][2]["source"] = ["# Config\nEPOCHS = 3\n"]
    assert any("os.environ" in p for p in _edit(good, edit))


def test_missing_what_you_learned_is_caught(good):
    def edit(nb):
        for c in nb["cells"]:
            c["source"] = [s.replace("What you learned", "Summary") for s in c["source"]]
    assert any("What you learned" in p for p in _edit(good, edit))


def test_missing_next_link_is_caught(good):
    shutil.copy(good, good.parent / "01_dataset_setup.ipynb")

    def edit(nb):
        nb["cells"][-1]["source"] = ["## What you learned\n- things\n"]
    assert any("link to the next notebook (01_dataset_setup.ipynb)" in p for p in _edit(good, edit))


def test_committed_outputs_are_caught(good):
    def edit(nb):
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        code[3]["execution_count"] = 7
        code[3]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["x\n"]}]
    problems = _edit(good, edit)
    assert any("committed outputs" in p for p in problems)
    nb = tpl.strip(json.loads(good.read_text()))
    good.write_text(json.dumps(nb))
    assert tpl.check_notebook(good) == []


def test_notebook_without_assertions_is_caught(good):
    def edit(nb):
        for c in nb["cells"]:
            if c["cell_type"] == "code":
                c["source"] = [s.replace("assert ", "print(") for s in c["source"]]
    assert any("asserts" in p for p in _edit(good, edit))


def test_write_renders_badges_and_setup_cell(good):
    def edit(nb):
        nb["cells"][0]["source"] = ["# 00 · Title\n", "\n", "## What you will learn\n", "- x\n"]
        nb["cells"][1]["source"] = ["# Setup (safe to re-run)\n"]
    assert _edit(good, edit)
    assert tpl.main(["--write", str(good.parent)]) == 0
    assert tpl.check_notebook(good) == []
    assert tpl.main(["--check", str(good.parent)]) == 0


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_nbformat(path: Path):
    import warnings

    import nbformat

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. MissingIDFieldWarning
        nbformat.validate(nbformat.read(path, as_version=4))


def test_strip_gives_missing_cell_ids(good):
    nb = json.loads(good.read_text())
    nb["nbformat_minor"] = 5
    for c in nb["cells"]:
        c.pop("id", None)
    tpl.strip(nb)
    ids = [c["id"] for c in nb["cells"]]
    assert len(set(ids)) == len(ids) == len(nb["cells"])
