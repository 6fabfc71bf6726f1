# tpu-notebooks: every command a user or CI needs. Run `make help`.
# The venv is created once from requirements.txt and reused; it is rebuilt only when
# requirements.txt or pyproject.toml change.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# per-cell timeout (nbmake); each notebook is budgeted 90 s in total (make run-notebooks checks)
NB_TIMEOUT ?= 120

.PHONY: help setup lab test lint unit notebooks run-notebooks bench strip template clean

help:
	@echo "make lab            set up (once) and open JupyterLab on notebooks/ (local XLA:CPU emulation)"
	@echo "make test           set up (once) and run lint + unit tests + every notebook (nbmake)"
	@echo "make run-notebooks  execute every notebook into outputs/ and print a timing table"
	@echo "make bench          run every benchmark and print one table"
	@echo "make strip          strip outputs/execution counts from notebooks/*.ipynb"
	@echo "make template       rewrite badges and setup cells from tpu_helpers/notebook_template.py"

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

setup: $(STAMP)

ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks --config=$(CURDIR)/jupyter_server_config.py $(ROOT_FLAG) $(LAB_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check tpu_helpers tests notebooks benchmarks scripts
	$(BIN)/python -m tpu_helpers.notebook_template --check notebooks

# One pytest run: unit tests and every notebook, so the closing line counts both.
test: lint
	$(BIN)/python -m pytest tests notebooks --nbmake --nbmake-timeout=$(NB_TIMEOUT) -p no:cacheprovider --durations=20

unit: $(STAMP)
	$(BIN)/python -m pytest tests -p no:cacheprovider

notebooks: $(STAMP)
	$(BIN)/python -m pytest notebooks --nbmake --nbmake-timeout=$(NB_TIMEOUT) -p no:cacheprovider

run-notebooks: $(STAMP)
	$(BIN)/python scripts/run_notebooks.py notebooks outputs

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

strip: $(STAMP)
	$(BIN)/python -m tpu_helpers.notebook_template --strip notebooks

template: $(STAMP)
	$(BIN)/python -m tpu_helpers.notebook_template --write notebooks

clean:
	rm -rf outputs .pytest_cache .ruff_cache .hypothesis
