"""Every notebook follows the template; a notebook that breaks it is caught."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import notebook_template as tpl  # scripts/ (repository tooling), on the path via conftest
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = tpl.notebooks(REPO / "notebooks")
COURSE = ["00_environment", "01_dataset_setup", "02_parallel_loader", "03_multicore_training",
          "04_prediction_gathering", "05_performance_debugging", "06_lightning_on_tpu",
          "07_model_sharding_spmd", "08_myths_and_facts",
          "09_transformers_variable_length", "10_bigger_than_one_chip",
          "11_hugging_face_on_tpu", "12_accelerate_and_fsdp_v2", "13_your_data_to_a_submission",
          "14_fine_tune_a_hub_model"]

pytestmark = pytest.mark.one_line  # the notebooks' format, budget and stderr checks


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


#: A valid course block for fixture notebooks.
COURSE_META = {"teaches": ["TPU layouts", "lazy execution"],
               "devices": "One XLA:CPU device here; the TPU's devices on Colab or Kaggle.",
               "budget_seconds": 60}


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A conforming notebook (a copy of 00 with a valid course block) in a folder of its own."""
    dst = tmp_path / "00_environment.ipynb"
    nb = json.loads((REPO / "notebooks" / "00_environment.ipynb").read_text())
    nb["metadata"][tpl.COURSE_KEY] = dict(COURSE_META)
    dst.write_text(json.dumps(nb))
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


def test_long_setup_cell_is_caught(good):
    """A setup cell that grows back (the old one had 31 lines: clone and wheel fallbacks)."""
    def grow(nb):
        nb["cells"][1]["source"].extend(f"\n# fallback line {i}" for i in range(23))
    assert any(f"more than {tpl.MAX_SETUP_LINES}" in p for p in _edit(good, grow))


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


# ------------------------------------------------------ the metadata that asks for a TPU on open


def test_notebooks_ask_colab_and_kaggle_for_a_tpu():
    for path in NOTEBOOKS:
        meta = json.loads(path.read_text())["metadata"]
        assert meta["accelerator"] == "TPU" and meta["colab"]["gpuType"] == "V5E1", path.name
        assert meta["kaggle"]["isInternetEnabled"] is True, path.name
        assert meta["kaggle"]["accelerator"] == tpl.NOTEBOOK_METADATA["kaggle"]["accelerator"]
        assert "dockerImageVersionId" not in meta["kaggle"], path.name


@pytest.mark.parametrize("key", ["accelerator", "colab", "kaggle"])
def test_missing_tpu_metadata_is_caught(good, key):
    problems = _edit(good, lambda nb: nb["metadata"].pop(key))
    assert any(p.startswith(f"metadata.{key}") for p in problems), problems


def test_wrong_tpu_metadata_values_are_caught(good):
    def edit(nb):
        nb["metadata"]["colab"]["gpuType"] = "T4"
        nb["metadata"]["kaggle"]["isInternetEnabled"] = False
        nb["metadata"]["kaggle"]["dockerImageVersionId"] = 31259
    problems = _edit(good, edit)
    assert any("metadata.colab lacks gpuType" in p for p in problems)
    assert any("metadata.kaggle lacks isInternetEnabled" in p for p in problems)
    assert any("dockerImageVersionId pins a CPU/GPU image" in p for p in problems)


def test_missing_runtime_menu_line_is_caught(good):
    def drop(nb):
        nb["cells"][0]["source"] = [ln for ln in nb["cells"][0]["source"]
                                    if not ln.startswith(tpl.RUNTIME_PREFIX)]
    assert any("which menu picks a TPU" in p for p in _edit(good, drop))


def test_write_restores_metadata_and_keeps_other_keys(good):
    def edit(nb):
        nb["metadata"] = {"kernelspec": nb["metadata"]["kernelspec"],
                          tpl.COURSE_KEY: nb["metadata"][tpl.COURSE_KEY],
                          "colab": {"toc_visible": True},
                          "kaggle": {"accelerator": "none", "dockerImageVersionId": 30646}}
    assert _edit(good, edit)
    assert tpl.main(["--write", str(good)]) == 0
    meta = json.loads(good.read_text())["metadata"]
    assert tpl.check_notebook(good) == []
    assert meta["colab"]["toc_visible"] is True and "kernelspec" in meta
    assert "dockerImageVersionId" not in meta["kaggle"]


# ------------------------------------- per-notebook course metadata, the budget, the README table


def test_missing_course_metadata_is_caught(good):
    problems = _edit(good, lambda nb: nb["metadata"].pop(tpl.COURSE_KEY))
    assert any(p.startswith(f"metadata.{tpl.COURSE_KEY} is missing") for p in problems)


@pytest.mark.parametrize("key, value, says", [
    ("teaches", [], "teaches must be a non-empty list"),
    ("teaches", "lazy execution", "teaches must be a non-empty list"),
    ("teaches", ["ok", ""], "teaches must be a non-empty list"),
    ("teaches", ["x" * 91], "teaches items over 90 characters"),
    ("devices", "", "devices must be one sentence"),
    ("devices", "TPU", "devices must be one sentence"),
    ("devices", "One XLA:CPU device here, the TPU there", "devices must be one sentence"),
    ("budget_seconds", 91, "budget_seconds must be an int from 1 to 90"),
    ("budget_seconds", 60.0, "budget_seconds must be an int"),
    ("budget_seconds", True, "budget_seconds must be an int"),
    ("budget_seconds", None, "budget_seconds must be an int"),
    ("extra", 1, "unknown keys ['extra']"),
])
def test_bad_course_metadata_is_caught(good, key, value, says):
    def edit(nb):
        nb["metadata"][tpl.COURSE_KEY][key] = value
    problems = _edit(good, edit)
    assert any(says in p for p in problems), problems


def test_write_keeps_course_metadata(good):
    assert tpl.main(["--write", str(good)]) == 0
    meta = json.loads(good.read_text())["metadata"]
    assert meta[tpl.COURSE_KEY] == COURSE_META


def test_budget_comes_from_the_notebook(good, monkeypatch):
    import notebook_budget

    assert tpl.budget_seconds(good) == 60
    _edit(good, lambda nb: nb["metadata"].pop(tpl.COURSE_KEY))
    assert tpl.budget_seconds(good) == tpl.MAX_BUDGET_S == 90  # none: the template's 90 s
    monkeypatch.delenv("TPU_NB_BUDGET", raising=False)
    assert notebook_budget.budget_for(good) == 90
    monkeypatch.setenv("TPU_NB_BUDGET", "600")  # a loaded machine: one override for all
    assert notebook_budget.budget_for(good) == 600
    monkeypatch.delenv("TPU_NB_BUDGET")
    monkeypatch.setenv("TPU_NB_MACHINE_FACTOR", "2.50")  # a calibrated run on a slow machine
    assert notebook_budget.budget_for(good) == 225


@pytest.mark.slow
def test_a_notebook_over_its_budget_fails_the_test_run(tmp_path):
    """Calibrated as `make test` runs it: the header gives the machine factor (1 to 4), and a
    notebook over 4 times its budget fails on any machine."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(4.5)")]
    nb.metadata[tpl.COURSE_KEY] = {**COURSE_META, "budget_seconds": 1}
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                 "name": "python3"}
    nbformat.write(nb, tmp_path / "00_slow.ipynb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_NB_")}
    env.update(PYTHONPATH=str(REPO), TPU_NB_CALIBRATE="1")  # (no -q: it hides the header)
    proc = subprocess.run([sys.executable, "-m", "pytest", "00_slow.ipynb", "--nbmake",
                           "-p", "scripts.notebook_budget", "-p", "no:cacheprovider"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:]
    plain = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # nbmake colours its report
    header = re.search(r"notebook budgets x(\d\.\d\d): a fresh import of torch_xla took "
                       r"(\d+\.\d) s", plain)
    assert header and 1 <= float(header[1]) <= 4, plain[:3000]
    print(header[0])
    assert re.search(r"00_slow.ipynb ran \d+ s, over its \d+ s budget \(.*machine factor "
                     + re.escape(header[1]), plain), plain[-3000:]


@pytest.mark.slow
def test_a_notebook_with_unexplained_stderr_fails_the_test_run(tmp_path):
    """Noise a learner would see (a banner, a warning) fails the notebook and is named, with
    its cell; the executed copy is kept when TPU_NB_EXECUTED names a folder."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('fine')"),
                nbformat.v4.new_code_cell(
                    "import sys\nprint('GPU available: False, used: False', file=sys.stderr)"),
                # C++ code and child processes write to fd 2 itself: a learner sees that too
                nbformat.v4.new_code_cell(
                    "import os\nos.write(2, b'W external/xla/some_file.cc:1] a C++ notice\\n')")]
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                 "name": "python3"}
    nbformat.write(nb, tmp_path / "00_noisy.ipynb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_NB_")}
    env.update(PYTHONPATH=str(REPO), TPU_NB_EXECUTED=str(tmp_path / "executed"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "00_noisy.ipynb", "--nbmake",
                           "-p", "scripts.notebook_budget", "-p", "no:cacheprovider", "-q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)
    assert proc.returncode == 1, plain[-2000:]
    assert "00_noisy.ipynb shows 2 stderr line(s)" in plain, plain[-3000:]
    assert "cell 1: GPU available: False" in plain, plain[-3000:]
    assert "cell 2: W external/xla/some_file.cc:1] a C++ notice" in plain, plain[-3000:]
    assert (tmp_path / "executed" / "00_noisy.ipynb").exists()


def test_course_table_renders_each_notebook(good):
    other = good.parent / "01_other.ipynb"
    shutil.copy(good, other)
    _edit(other, lambda nb: nb["metadata"].pop(tpl.COURSE_KEY))
    rows = tpl.course_table(good.parent).splitlines()
    title = json.loads(good.read_text())["cells"][0]["source"][0].removeprefix("# ").strip()
    folder = good.parent.name
    assert rows[0] == "| notebook | what it teaches | devices | budget |"
    assert rows[2] == (f"| [{title}]({folder}/00_environment.ipynb) | TPU layouts; lazy "
                       f"execution | {COURSE_META['devices']} | 60 s |")
    assert rows[3].endswith(f"| (no valid {tpl.COURSE_KEY} metadata) | | |")
    readme = good.parent / "README.md"
    readme.write_text(f"# x\n\n{tpl.README_START}\nold\n{tpl.README_END}\n\nrest\n")
    assert tpl.main(["--readme", str(readme), str(good.parent)]) == 1  # 01 lacks metadata
    text = readme.read_text()
    assert tpl.readme_table(text) == tpl.course_table(good.parent)
    assert text.startswith("# x\n\n") and text.endswith("\n\nrest\n")


def test_readme_course_table_is_generated_from_the_notebooks():
    committed = tpl.readme_table((REPO / "README.md").read_text())
    assert committed == tpl.course_table(REPO / "notebooks"), (
        "run `python scripts/notebook_template.py --readme README.md`")


# ------------------------------------------ the articles the course corrects, named by title

#: Internal names for the corrected articles ("seed 002", "the seed loop", ...): a learner cannot
#: tell what they mean, and "seed" is the RNG seed in the same cells. Name the article instead.
INTERNAL_ARTICLE_NAME = re.compile(
    r"seed[ _-]articles?|seed 00[0-3]|seeds 000|seed loop|shared/seeds|seed's|the seeds|"
    r"seed-style|seed_style|seed_loop|seed[ _-]?00|#\s*seed:|as in the seed\b", re.IGNORECASE)
ARTICLE_TITLES = ("How can prediction results be gathered on a TPU using PyTorch?",
                  "How does PyTorch Lightning handle data parallelism on TPUs",
                  "How can I train a PyTorch model on a TPU using a custom dataset?",
                  "TPU training (Basic)")


def _learner_facing_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "GUIDE.md", REPO / "CONTRIBUTING.md",
             REPO / "notebooks" / "README.md", *NOTEBOOKS]
    for folder in ("course", "tpu_helpers", "benchmarks", "scripts"):
        files += [f for f in sorted((REPO / folder).rglob("*"))
                  if f.is_file() and "__pycache__" not in f.parts]
    return files


def test_articles_are_named_by_title_never_by_an_internal_name():
    found = []
    for path in _learner_facing_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{n}: {m.group(0)!r}"
                      for m in INTERNAL_ARTICLE_NAME.finditer(line)]
    assert not found, "name the article by its title (see the README), not:\n" + "\n".join(found)


def test_readme_names_the_four_articles_the_course_corrects():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("### The articles this course corrects", 1)
    assert len(section) == 2, "README lacks the section 'The articles this course corrects'"
    missing = [title for title in ARTICLE_TITLES if f'"{title}"' not in section[1]]
    assert not missing, f"README does not name: {missing}"


# The setup cell run for real (wheel, folder, failure, local): tests/test_setup_cell.py.


# ------------------------------------------------- local JupyterLab: outputs stripped on save


def _notebook_with_outputs():
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)", execution_count=3)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nb.cells = [nbformat.v4.new_markdown_cell("# x"), cell]
    return nb


def test_pre_save_hook_strips_notebooks_under_the_folder_only(tmp_path):
    class Manager:  # what the hook reads from jupyter_server's contents manager
        root_dir = str(tmp_path)

    hook = tpl.strip_on_save(tmp_path / "notebooks")
    inside = {"type": "notebook", "content": _notebook_with_outputs()}
    hook(model=inside, path="notebooks/00_x.ipynb", contents_manager=Manager())
    code = inside["content"].cells[1]
    assert code.outputs == [] and code.execution_count is None
    outside = {"type": "notebook", "content": _notebook_with_outputs()}
    hook(model=outside, path="scratch/x.ipynb", contents_manager=Manager())
    assert outside["content"].cells[1].outputs
    text = {"type": "file", "content": "x", "format": "text"}
    hook(model=text, path="notebooks/notes.txt", contents_manager=Manager())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jupyter_server_with_the_repo_config_saves_without_outputs(tmp_path):
    """A real jupyter server with the repository's config, saving through its REST API."""
    root = tmp_path / "repo"
    (root / "notebooks").mkdir(parents=True)
    (root / "scratch").mkdir()
    shutil.copy(REPO / "jupyter_server_config.py", root)  # it strips under its own notebooks/
    (root / "scripts").mkdir()  # with the hook it imports from the repository's scripts/
    shutil.copy(REPO / "scripts" / "notebook_template.py", root / "scripts")
    port, token = _free_port(), "test-token"
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", f"--config={root / 'jupyter_server_config.py'}",
         f"--ServerApp.root_dir={root}", f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", "--ServerApp.open_browser=False",
         "--ServerApp.port_retries=0", "--allow-root"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
             "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "JUPYTER_DATA_DIR": str(tmp_path / "d")})
    base = f"http://127.0.0.1:{port}/api/contents"
    headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}

    def request(method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{base}/{path}", data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    try:
        for _ in range(300):
            try:
                request("GET", "")
                break
            except OSError:
                if server.poll() is not None:
                    raise AssertionError(server.stderr.read()) from None
                time.sleep(0.2)
        nb = _notebook_with_outputs()
        for folder in ("notebooks", "scratch"):
            request("PUT", f"{folder}/00_saved.ipynb",
                    {"type": "notebook", "format": "json", "content": nb})
        saved = json.loads((root / "notebooks" / "00_saved.ipynb").read_text())
        code = saved["cells"][1]
        assert code["outputs"] == [] and code["execution_count"] is None
        kept = json.loads((root / "scratch" / "00_saved.ipynb").read_text())
        assert kept["cells"][1]["outputs"] and kept["cells"][1]["execution_count"] == 3
    finally:
        server.terminate()
        server.wait(timeout=30)


# --------------------------------------------------- a notebook run twice in one kernel


@pytest.mark.slow
def test_notebook_00_run_twice_in_one_kernel_says_restart(monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from course.setup import RERUN_SENTENCE

    monkeypatch.setenv("SMOKE", "1")
    nb = nbformat.read(REPO / "notebooks" / "00_environment.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):  # the first run-all passes
            client.execute_cell(cell, i)
        first_error = None
        for i, cell in enumerate(nb.cells):  # the second one stops at the setup cell
            try:
                client.execute_cell(cell, i)
            except CellExecutionError as exc:
                first_error = (i, exc)
                break
    assert first_error is not None, "a second run-all in the same kernel must not pass silently"
    index, exc = first_error
    assert _src(nb.cells[index]).startswith(tpl.SETUP_MARKER)
    assert exc.ename == "EnvironmentProblem" and RERUN_SENTENCE in exc.evalue


def test_missing_checked_section_is_caught(good):
    def edit(nb):
        for c in nb["cells"]:
            c["source"] = [s.replace(tpl.CHECKED_HEADING, "Evidence") for s in c["source"]]
    assert any(tpl.CHECKED_HEADING in p for p in _edit(good, edit))


def test_checked_section_before_what_you_learned_is_caught(good):
    def edit(nb):
        i = next(i for i, c in enumerate(nb["cells"]) if tpl.CHECKED_HEADING in _src(c))
        nb["cells"].insert(3, nb["cells"].pop(i))
    assert any(tpl.CHECKED_HEADING in p for p in _edit(good, edit))
