"""Write the datasets shipped in data/ (run once; the output is committed).

    .venv/bin/python data/make_data.py

Sources (both bundled inside scikit-learn, so nothing is downloaded):

* ``digits/``: the 1,797 8x8 handwritten digits (UCI "Optical Recognition of Handwritten
  Digits"), one greyscale PNG per image plus ``digits/labels.csv`` with the columns
  ``file,label,split``. Pixel counts 0..16 are stored as ``round(v * 255 / 16)``.
  ``split`` is a fixed stratified 80/20 train/test split (random_state=0).
* ``breast_cancer.csv``: the 569-row Breast Cancer Wisconsin (Diagnostic) table, 30
  float features and a ``target`` column (0 = malignant, 1 = benign), plus ``split``.

The script is deterministic: running it again rewrites byte-identical files.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split

HERE = Path(__file__).resolve().parent


def _split(labels: np.ndarray, test_size: float = 0.2, seed: int = 0) -> list[str]:
    idx = np.arange(len(labels))
    _, test_idx = train_test_split(idx, test_size=test_size, stratify=labels,
                                   random_state=seed)
    split = np.array(["train"] * len(labels), dtype=object)
    split[test_idx] = "test"
    return list(split)


def write_digits(out: Path) -> None:
    d = load_digits()
    images = np.rint(d.images * 255.0 / 16.0).astype(np.uint8)
    labels = d.target.astype(int)
    split = _split(labels)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (img, lab, sp) in enumerate(zip(images, labels, split, strict=True)):
        name = f"images/{i:04d}.png"
        # optimize=False and no metadata: the bytes depend on the pixels only.
        Image.fromarray(img, mode="L").save(out / name, format="PNG")
        rows.append((name, int(lab), sp))
    with open(out / "labels.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["file", "label", "split"])
        w.writerows(rows)


def write_breast_cancer(path: Path) -> None:
    b = load_breast_cancer()
    names = [n.replace(" ", "_") for n in b.feature_names]
    labels = b.target.astype(int)
    split = _split(labels)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow([*names, "target", "split"])
        for row, lab, sp in zip(b.data, labels, split, strict=True):
            w.writerow([*(repr(float(v)) for v in row), int(lab), sp])


if __name__ == "__main__":
    write_digits(HERE / "digits")
    write_breast_cancer(HERE / "breast_cancer.csv")
    print(f"wrote {HERE / 'digits'} and {HERE / 'breast_cancer.csv'}")
