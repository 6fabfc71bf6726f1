"""A competition-shaped folder for notebook 13, built from the bundled 8x8 digits: what a
Kaggle competition's data tab gives you (``train.csv`` with a label column, ``test.csv``
without, ``sample_submission.csv``), plus the test answers kept outside the folder, as the
competition keeps them, to score a submission.

Demo data only: nothing here is part of the toolkit. The ids are random strings and the test
rows are in no particular order, so a submission is right only if it keeps the file's ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from course.datasets import DIGITS_MEAN, DIGITS_STD, load_digits

PIXELS = [f"pixel{k}" for k in range(64)]


def _ids(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct random ids like ``"a3f09c1e"``."""
    return [f"{k:08x}" for k in rng.choice(16**8, size=n, replace=False)]


def make_competition_folder(folder: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.csv`` (``id``, 64 pixel columns 0..255, ``label``), ``test.csv`` (the same
    without ``label``, rows shuffled) and ``sample_submission.csv`` (``id``, ``label``) into
    ``folder``; the test answers go to ``answers.csv`` beside it. Returns both paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (x_train, y_train), (x_test, y_test) = load_digits("train"), load_digits("test")
    order = rng.permutation(len(x_test))
    for name, x, y in (("train", x_train, y_train), ("test", x_test[order], y_test[order])):
        png = (x.reshape(len(x), -1) * DIGITS_STD + DIGITS_MEAN) * 255  # back to 0..255
        pixels = np.rint(png).astype(np.int64)
        frame = pd.DataFrame(pixels, columns=PIXELS)
        frame.insert(0, "id", _ids(rng, len(x)))
        if name == "train":
            frame["label"] = y
        else:
            frame[["id"]].assign(label=0).to_csv(folder / "sample_submission.csv", index=False)
            answers = folder.with_name(folder.name + "-answers.csv")
            frame[["id"]].assign(label=y).to_csv(answers, index=False)
        frame.to_csv(folder / f"{name}.csv", index=False)
    return folder, answers
