# tpu-notebooks: every command a user or CI needs. Run `make help`.
# A venv per torch_xla line, created once and reused, rebuilt only when its requirements or
# pyproject.toml change: .venv (torch_xla 2.9, requirements.txt, the default) and
# .venv-2.8 (requirements-2.8.txt). XLA=2.8 makes any target below use the 2.8 one.
# Venvs are built with uv (pinned, bootstrapped into .tools/ by pip): about 30 s instead of
# several minutes, and the second venv reuses the first one's files from uv's cache.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY ?= python3
XLA ?= 2.9
XLA_LINES := 2.9 2.8
VENV := $(if $(filter 2.9,$(XLA)),.venv,.venv-$(XLA))
REQS := $(if $(filter 2.9,$(XLA)),requirements.txt,requirements-$(XLA).txt)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
UV := .tools/bin/uv
UV_VERSION := 0.13.9
export UV_PYTHON_DOWNLOADS := never
# per-cell timeout (nbmake); each notebook is budgeted 90 s in total (scripts/notebook_budget.py fails it)
NB_TIMEOUT ?= 120
# pytest workers (pytest-xdist, one test file per worker at a time): most tests wait on
# subprocesses and imports, so 2 workers on 2 cores halve the wall time of `make test`
JOBS ?= 2

.PHONY: help setup lab test test-one lint unit notebooks run-notebooks bench strip template \
        wheel tpu-check clean test-tpu-numerics test-jax test-jax-one $(addprefix test-,$(XLA_LINES))

help:
	@echo "make lab            set up (once) and open JupyterLab on notebooks/ (local XLA:CPU emulation)"
	@echo "make test           lint, unit tests + every notebook on torch_xla 2.9, again on 2.8, then the TPU-numerics lane"
	@echo "make test-2.9       the same on one torch_xla line only (test-2.8 likewise)"
	@echo "make test-tpu-numerics  every notebook again with a TPU's matmul numerics emulated (bf16 inputs)"
	@echo "make test-jax       the SPMD/scan/attention notebooks and jax-path tests with jax importable, on 2.9 and 2.8"
	@echo "make run-notebooks  execute every notebook into outputs/ and print a timing table"
	@echo "make bench          run every benchmark and print one table"
	@echo "make wheel          build dist/tpu_helpers-*.whl (the toolkit and the course data)"
	@echo "make kaggle-dataset build dist/kaggle-dataset/: the wheels to attach on Kaggle with Internet off"
	@echo "make tpu-check      on a TPU VM/Colab/Kaggle: run every notebook at full settings, record results"
	@echo "make strip          strip outputs/execution counts from notebooks/*.ipynb"
	@echo "make template       rewrite badges, metadata and setup cells, and the README course table"
	@echo "Any target with XLA=2.8 uses the torch_xla 2.8 environment (.venv-2.8)."

$(UV):
	$(PY) -m venv .tools
	.tools/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(STAMP): $(REQS) requirements-common.txt pyproject.toml | $(UV)
	@$(PY) -c 'import sys; sys.exit("Python >= 3.11 is needed (transformers 5, notebook 11); " + sys.version.split()[0] + " found: make setup PY=python3.11" if sys.version_info < (3, 11) else 0)'
	@test -x $(BIN)/python || $(UV) venv --quiet --seed --python $(PY) $(VENV)
	VIRTUAL_ENV=$(VENV) $(UV) pip install --quiet -r $(REQS)
	VIRTUAL_ENV=$(VENV) $(UV) pip install --quiet --no-deps -e .
	@touch $(STAMP)

setup: $(STAMP)

ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks --config=$(CURDIR)/jupyter_server_config.py $(ROOT_FLAG) $(LAB_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check tpu_helpers course tests notebooks benchmarks scripts examples
	$(BIN)/python scripts/notebook_template.py --check notebooks

# Lint once, then one pytest run (unit tests and every notebook) per torch_xla line, then every
# notebook again under the TPU-numerics lane (2.9), then the jax lane (both lines). Tests marked
# `one_line` (they do not depend on the torch_xla line: packaging, the setup cell, notebook
# format, the lanes' own tests) run on the first line only; `make test-2.8` alone still runs them.
test: lint $(addprefix test-,$(XLA_LINES)) test-tpu-numerics test-jax
	@echo "make test: passed on torch_xla $(XLA_LINES), under the TPU-numerics lane and the jax lane"

$(addprefix test-,$(XLA_LINES)): test-%:
	$(MAKE) --no-print-directory XLA=$* test-one \
	  $(if $(and $(filter test,$(MAKECMDGOALS)),$(filter-out $(firstword $(XLA_LINES)),$*)),MARK="not one_line")

MARK ?=
test-one: $(STAMP)
	@echo "== torch_xla $$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("torch_xla"))') in $(VENV) =="
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile tests notebooks --nbmake --nbmake-timeout=$(NB_TIMEOUT) -p no:cacheprovider --durations=15 $(if $(MARK),-m "$(MARK)")

# The TPU-numerics lane: every notebook again, with XLA:CPU rounding the float32 inputs of each
# matmul/convolution to bfloat16 as a TPU does at its default precision (scripts/tpu_numerics,
# installed in every process by its sitecustomize). Fails unless the emulation rounded matmuls in
# each notebook's processes. Time is not what this lane checks: the emulation costs time, so the
# per-notebook budget is relaxed here (the main lanes enforce it).
TPU_NUMERICS_DIR := $(CURDIR)/outputs/tpu-numerics
test-tpu-numerics: $(STAMP)
	rm -rf $(TPU_NUMERICS_DIR)
	TPU_NUMERICS=1 TPU_NUMERICS_DIR=$(TPU_NUMERICS_DIR) TPU_NB_BUDGET=300 \
	PYTHONPATH=$(CURDIR)/scripts/tpu_numerics$${PYTHONPATH:+:$$PYTHONPATH} \
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile -p tpu_numerics_lane notebooks --nbmake \
	  --nbmake-timeout=$(NB_TIMEOUT) -p no:cacheprovider --durations=9

# The jax lane: Colab's and Kaggle's TPU images ship jax 0.7.2 (and flax) beside torch_xla, and
# torch_xla takes other code paths when jax imports (torchax via xs.mark_sharding, shard_as, scan's
# backward under SPMD). The packages of requirements-jax-lane.txt go, without their dependencies,
# into an overlay folder on PYTHONPATH (built once, rebuilt when that file changes); the venvs and
# their requirements are untouched, and a check refuses an overlay that shadows a venv package.
# On each line it runs the notebooks whose processes import jax (SPMD, sharding, scan, the flash
# branch: 02 03 04 07 10; 11's Trainer through MpDeviceLoader, whose worker's xp.Trace imports jax
# (torch_xla/debug/profiler.py); 12's FSDPv2 script imports torchax through mark_sharding; 09's
# attention never does, so it is left out) and the tests of the jax
# paths; the plugin (scripts/jax_lane) fails a notebook whose processes did not have jax. Time is
# not what it checks (the main lanes enforce each notebook's budget). Its own artifact: on a host
# without TPU chips, jax's backend start sets TPU_SKIP_MDS_QUERY=1 (jax/_src/cloud_tpu_init.py),
# after which torch_xla's tpu.version() needs TPU_ACCELERATOR_TYPE and Lightning's
# XLAAccelerator.is_available raises TypeError; no notebook of this lane uses Lightning.
JAX_OVERLAY := $(CURDIR)/.jax-overlay
JAX_LANE_DIR := $(CURDIR)/outputs/jax-lane
JAX_NOTEBOOKS := $(addprefix notebooks/,02_parallel_loader.ipynb 03_multicore_training.ipynb \
  04_prediction_gathering.ipynb 07_model_sharding_spmd.ipynb 10_bigger_than_one_chip.ipynb \
  11_hugging_face_on_tpu.ipynb 12_accelerate_and_fsdp_v2.ipynb)
JAX_TESTS := tests/test_jax_paths.py tests/test_jax_lane.py tests/test_text_model.py

$(JAX_OVERLAY)/.installed: requirements-jax-lane.txt | $(STAMP)
	rm -rf $(JAX_OVERLAY)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps \
	  --target $(JAX_OVERLAY) -r requirements-jax-lane.txt
	@touch $@

test-jax:
	$(MAKE) --no-print-directory XLA=2.9 test-jax-one
	$(MAKE) --no-print-directory XLA=2.8 test-jax-one

test-jax-one: $(STAMP) $(JAX_OVERLAY)/.installed
	@echo "== jax lane: torch_xla $$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("torch_xla"))') in $(VENV) + $(JAX_OVERLAY) =="
	$(BIN)/python scripts/jax_lane/check_overlay.py $(JAX_OVERLAY) $(VENV)
	rm -rf $(JAX_LANE_DIR)/$(XLA)
	JAX_LANE=1 JAX_LANE_DIR=$(JAX_LANE_DIR)/$(XLA) TPU_NB_BUDGET=300 \
	PYTHONPATH=$(CURDIR)/scripts/jax_lane:$(JAX_OVERLAY)$${PYTHONPATH:+:$$PYTHONPATH} \
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile -p jax_lane $(JAX_TESTS) $(JAX_NOTEBOOKS) \
	  --nbmake --nbmake-timeout=$(NB_TIMEOUT) -p no:cacheprovider --durations=9

unit: $(STAMP)
	$(BIN)/python -m pytest tests -p no:cacheprovider

notebooks: $(STAMP)
	$(BIN)/python -m pytest notebooks --nbmake --nbmake-timeout=$(NB_TIMEOUT) -p no:cacheprovider

run-notebooks: $(STAMP)
	$(BIN)/python scripts/run_notebooks.py notebooks outputs

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

strip: $(STAMP)
	$(BIN)/python scripts/notebook_template.py --strip notebooks

template: $(STAMP)
	$(BIN)/python scripts/notebook_template.py --write notebooks
	$(BIN)/python scripts/notebook_template.py --readme README.md

wheel: $(STAMP)
	rm -rf dist build
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir dist .

# On a TPU (VM, Colab, Kaggle), in the platform's own Python: no venv of ours there.
tpu-check:
	$(PY) scripts/tpu_check.py

clean:
	rm -rf outputs .pytest_cache .ruff_cache .hypothesis dist build

# The Kaggle dataset for notebooks run with Internet off (README "Kaggle with Internet off"):
# this package's wheel plus every wheel the notebooks need that Kaggle's TPU image lacks, for its
# Python 3.12 (manylinux x86_64), from the package index, and dataset-metadata.json.
# Upload: kaggle datasets create -p dist/kaggle-dataset. KAGGLE_OWNER=you sets the dataset's id.
KAGGLE_OWNER ?= YOUR-KAGGLE-USERNAME
.PHONY: kaggle-dataset
kaggle-dataset: $(STAMP)
	$(BIN)/python scripts/kaggle_dataset.py dist/kaggle-dataset --owner $(KAGGLE_OWNER)
