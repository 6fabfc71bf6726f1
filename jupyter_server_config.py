"""Jupyter server config for this repository; ``make lab`` passes it with ``--config``.

Every save of a notebook under ``notebooks/`` (autosave included) writes it without outputs
and execution counts, exactly as ``make strip`` would, so ``make test`` never finds committed
outputs. Outputs stay visible in the open tab until it is reloaded. Other folders are untouched.
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from notebook_template import strip_on_save  # noqa: E402 (repository tooling in scripts/)

c = get_config()  # noqa: F821 (provided by Jupyter when it loads this file)
c.ContentsManager.pre_save_hook = strip_on_save(Path(__file__).resolve().parent / "notebooks")
# `jupyter lab` applies this config twice; the second time traitlets warns about our own hook.
warnings.filterwarnings("ignore", message="Overriding existing pre_save_hook")
