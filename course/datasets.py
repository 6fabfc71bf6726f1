"""The course's datasets (course only; taught in ``notebooks/01_dataset_setup.ipynb``): the
digits shipped with the repository, a labelled CSV of image files, a tabular CSV. Every bad
line is a :class:`tpu_helpers.data.DataError` naming file and line."""

from __future__ import annotations

import csv
import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from tpu_helpers.data import DataError, check_labels

#: Mean and standard deviation of ``png / 255`` over the digits training split.
DIGITS_MEAN = 0.3054
DIGITS_STD = 0.3760
NUM_DIGIT_CLASSES = 10
SPLITS = ("train", "test")


def _select_split(table: pd.DataFrame, path: Path | str, split: str | None) -> pd.DataFrame:
    """Rows of ``split`` (all rows for None); a clear error for a bad split or no rows."""
    if split is not None:
        if split not in SPLITS:
            raise DataError(f"split must be one of {SPLITS} or None, got {split!r}.")
        if "split" not in table.columns:
            raise DataError(f"{path}: no 'split' column, cannot select split {split!r}.")
        table = table[table["split"] == split]
    if len(table) == 0:
        raise DataError(f"{path}: the dataset is empty (0 rows"
                        + (f" in split {split!r})." if split else ")."))
    return table


def data_dir() -> Path:
    """The data folder: ``$TPU_NB_DATA`` if set, else the repository's ``data/``, else the
    copy a ``tpu_helpers`` wheel installs (the ``tpu_notebooks_data`` package)."""
    override = os.environ.get("TPU_NB_DATA")
    if override:
        path = Path(override).expanduser()
        if not path.is_dir():
            raise DataError(f"TPU_NB_DATA={override!r} is not a directory.")
        return path
    repo = Path(__file__).resolve().parent.parent / "data"
    if repo.is_dir():
        return repo
    spec = importlib.util.find_spec("tpu_notebooks_data")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise DataError(f"no data folder: {repo} does not exist and the tpu_notebooks_data package "
                    "(in the tpu_helpers wheel) is not installed; set TPU_NB_DATA to a folder "
                    "laid out like the repository's data/.")


def decode_image(path: str | Path, size: tuple[int, int] | None = (8, 8),
                 mode: str | None = "L") -> np.ndarray:
    """Decode one image file to a ``uint8`` array ``[H, W]`` (mode L) or ``[H, W, C]``.

    Raises :class:`DataError` naming the file when it is missing, not an image,
    truncated or corrupt, or has another ``(height, width)`` or mode than asked, or
    declares more pixels than PIL's ``Image.MAX_IMAGE_PIXELS`` (a decompression bomb).
    Mode, size and pixel count are checked from the header, before any pixel is decoded.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found.")
    try:
        with Image.open(path) as im:
            _check_image_header(path, im, size, mode)
            im.load()  # decode fully now: truncation shows here, not later in a worker
            return np.asarray(im)
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"{path}: refused as a possible decompression bomb ({exc}).") from exc
    except UnidentifiedImageError as exc:
        raise DataError(f"{path}: not a readable image ({exc}).") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path}: corrupt or truncated image ({exc}).") from exc


def _check_image_header(path: Path, im: Any, size: tuple[int, int] | None,
                        mode: str | None) -> None:
    """Mode, size and pixel count as declared by the file, before decoding anything."""
    (w, h), limit = im.size, Image.MAX_IMAGE_PIXELS
    if limit and w * h > limit:  # PIL only warns up to 2x its limit, then decodes it all
        raise DataError(f"{path}: image size {h}x{w} (HxW) is {w * h} pixels, more than "
                        f"PIL's Image.MAX_IMAGE_PIXELS={limit}: refused as a possible "
                        "decompression bomb.")
    if mode is not None and im.mode != mode:
        raise DataError(f"{path}: image mode {im.mode!r}, expected {mode!r}.")
    if size is not None and (h, w) != tuple(size):
        raise DataError(f"{path}: image size {h}x{w} (HxW), expected {size[0]}x{size[1]}.")


def read_labels_csv(path: str | Path, num_classes: int | None = None,
                    split: str | None = None) -> Any:
    """Read a ``file,label[,split]`` CSV with pandas; check it; optionally keep one split.

    Returns a DataFrame indexed 0..N-1 (the dataset index) with int64 ``label`` and the
    CSV line number in column ``line`` (the header is line 1; blank lines are skipped but
    counted). Labels may be written ``3`` or ``3.0``. Raises :class:`DataError` naming
    the file and line for a ragged row, an empty ``file`` cell, a missing or non-integer
    label, a label below 0 (or not below ``num_classes``), or an image listed twice
    (anywhere in the file, whatever the split; a distinct message if the labels differ).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: labels file not found.")
    table, lines = _read_csv(path, dtype={"file": str, "split": str})
    for col in ("file", "label"):
        if col not in table.columns:
            raise DataError(f"{path}: no {col!r} column (columns: {list(table.columns)}).")
    if len(table) == 0:
        raise DataError(f"{path}: the dataset is empty (0 rows).")
    table["line"] = lines
    blank = table["file"].isna() | (table["file"].str.strip() == "")
    if blank.any():
        raise DataError(f"{path}: line {lines[int(np.flatnonzero(blank)[0])]} has no file "
                        "name (empty 'file' cell).")
    table["label"] = _integer_labels(table["label"], lines, path, "label")
    _check_listed_once(table, path)
    _check_label_range(table["label"].to_numpy(), lines, num_classes, path,
                       table["file"].to_numpy())
    return _select_split(table, path, split).reset_index(drop=True)


def _read_csv(path: Path, **read_csv: Any) -> tuple[pd.DataFrame, np.ndarray]:
    """``pandas.read_csv(path)`` and the CSV line each of its rows starts on.

    Checked first with the csv module: a header, and no ragged row. Blank (or
    whitespace-only) lines are skipped, as pandas does, but counted, so every message
    names the line a user sees in an editor.
    """
    lines = _data_lines(path)
    try:
        table = pd.read_csv(path, **read_csv)
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a readable CSV file ({exc}).") from exc
    if len(table) != len(lines):  # the csv module and pandas disagree: do not guess lines
        raise DataError(f"{path}: pandas read {len(table)} rows but the file has "
                        f"{len(lines)} non-blank rows after the header (check the quoting).")
    return table, lines


def _data_lines(path: Path) -> np.ndarray:
    """The line number each data row starts on; :class:`DataError` for no header or a row
    with another number of fields than the header."""
    header, lines, start = None, [], 1
    with open(path, newline="", encoding="utf-8") as f:  # pandas reads UTF-8 too
        reader = csv.reader(f)
        try:
            for row in reader:
                if row and (len(row) > 1 or row[0].strip()):  # pandas skips blank lines
                    if header is None:
                        header = row
                    elif len(row) != len(header):
                        raise DataError(f"{path}: line {start} has {len(row)} fields, the "
                                        f"header has {len(header)} (ragged rows).")
                    else:
                        lines.append(start)
                start = reader.line_num + 1  # a quoted field may span several lines
        except csv.Error as exc:
            raise DataError(f"{path}: line {start}: not a readable CSV row ({exc}).") from exc
        except UnicodeDecodeError as exc:  # decoded a block at a time: no line number
            raise DataError(f"{path}: not UTF-8 text ({exc}).") from exc
    if header is None:
        raise DataError(f"{path}: the file is empty (no header).")
    return np.asarray(lines, dtype=np.int64)


def _integer_labels(column: pd.Series, lines: np.ndarray, path: Path, name: str
                    ) -> np.ndarray:
    """``column`` as int64 (``3.0`` is 3); :class:`DataError` naming the line of the
    first missing, non-numeric or non-integral value."""
    if column.dtype.kind in "iu":
        return column.to_numpy(np.int64)
    values = pd.to_numeric(column, errors="coerce").to_numpy(np.float64)
    bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) > 2**53)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raw = column.iloc[i]
        got = ("a missing value" if pd.isna(raw) else
               repr(raw) if isinstance(raw, str) else str(raw))
        raise DataError(f"{path}: line {lines[i]}: label column {name!r} must hold "
                        f"integers, got {got}.")
    return values.astype(np.int64)


def _check_label_range(labels: np.ndarray, lines: np.ndarray, num_classes: int | None,
                       path: Path, files: np.ndarray | None = None) -> None:
    """Labels are ``>= 0`` (and ``< num_classes`` if given); the error names the CSV line.
    A table's target (no ``files``) without ``num_classes`` must be the classes 0..K-1."""
    def where(i: int) -> str:
        named = f" ({files[i]})" if files is not None else ""
        return f"line {lines[i]}{named}: label {labels[i]}"

    check_labels(labels, num_classes, str(path), where, dense=files is None)


def _check_listed_once(table: pd.DataFrame, path: Path) -> None:
    """Each image once in the whole file (``a/b.png`` and ``./a//b.png`` are the same)."""
    keys = table["file"].map(os.path.normpath)
    again = keys.duplicated()
    if not again.any():
        return
    second = int(np.flatnonzero(again)[0])
    first = int(np.flatnonzero(keys == keys.iloc[second])[0])
    name = table["file"].iloc[first]
    (l1, l2), (a, b) = table["line"].iloc[[first, second]], table["label"].iloc[[first, second]]
    if a != b:
        raise DataError(f"{path}: conflicting labels for {name}: {a} on line {l1}, {b} on "
                        f"line {l2}; each image must be listed once, with one label.")
    raise DataError(f"{path}: line {l2} lists {name} again (first on line {l1}); each image "
                    "must be listed once (in one split).")


class ImageFolderDataset(Dataset):
    """Images named by a ``file,label,split`` CSV, decoded with PIL into fixed-size tensors.

    The ``CustomImageDataset`` of the article "How can I train a PyTorch model on a TPU using a
    custom dataset?" done right: every file is decoded and checked once on construction
    (``verify=True``), so a missing, corrupt, truncated, wrong-size or wrong-mode file, or a label
    out of range, is a :class:`DataError` naming the file before any training starts, not a crash in
    a DataLoader worker mid-epoch or a recompile from an odd shape. Items are ``(x, y)`` with ``x``
    float32 ``[C, H, W]`` normalised as ``(pixel / 255 - mean) / std`` and ``y`` an int64 scalar.
    """

    def __init__(self, root: str | Path, split: str | None = None, *,
                 labels_csv: str = "labels.csv", size: tuple[int, int] = (8, 8),
                 mode: str = "L", num_classes: int | None = NUM_DIGIT_CLASSES,
                 mean: float = DIGITS_MEAN, std: float = DIGITS_STD,
                 verify: bool = True) -> None:
        self.root = Path(root)
        table = read_labels_csv(self.root / labels_csv, num_classes, split)
        self.files = [self.root / f for f in table["file"]]
        self.labels = table["label"].to_numpy(np.int64)
        self.size, self.mode, self.mean, self.std = tuple(size), mode, mean, std
        for f, line in zip(self.files, table["line"], strict=True):
            if not f.is_file():
                raise DataError(f"{f}: file not found (named on line {line} of "
                                f"{self.root / labels_csv}).")
        if verify:
            for f in self.files:
                decode_image(f, self.size, self.mode)

    def __len__(self) -> int:
        return len(self.files)

    def _to_tensor(self, arr: np.ndarray) -> np.ndarray:
        x = arr.astype(np.float32) / 255.0
        x = (x - self.mean) / self.std
        return x[None] if x.ndim == 2 else np.ascontiguousarray(x.transpose(2, 0, 1))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        arr = decode_image(self.files[index], self.size, self.mode)
        return torch.from_numpy(self._to_tensor(arr)), torch.tensor(self.labels[index])

    def to_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Decode everything once: ``(images float32 [N, C, H, W], labels int64 [N])``."""
        images = np.stack([self._to_tensor(decode_image(f, self.size, self.mode))
                           for f in self.files])
        return images.astype(np.float32, copy=False), self.labels.copy()


@functools.lru_cache(maxsize=8)
def _digits_arrays(folder: str, stamp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ds = ImageFolderDataset(folder, verify=False)  # to_arrays decodes (and checks) each file
    images, labels = ds.to_arrays()
    split = pd.read_csv(Path(folder) / "labels.csv", usecols=["split"])["split"].to_numpy()
    for a in (images, labels):
        a.setflags(write=False)
    return images, labels, split


def load_digits(split: str | None = None, root: str | Path | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """The shipped 8x8 digits: ``images`` float32 ``[N, 1, 8, 8]`` normalised, ``labels``
    int64 ``[N]``.

    ``split`` is ``"train"`` (1,437), ``"test"`` (360) or ``None`` (all 1,797), from the
    ``split`` column of ``digits/labels.csv``. ``root`` is the data folder (default
    :func:`data_dir`). Decoded once per process and cached; each call returns new arrays.
    """
    if split is not None and split not in SPLITS:
        raise DataError(f"split must be one of {SPLITS} or None, got {split!r}.")
    folder = Path(root if root is not None else data_dir()) / "digits"
    labels_csv = folder / "labels.csv"
    if not labels_csv.is_file():
        raise DataError(f"{labels_csv}: labels file not found (is TPU_NB_DATA right?).")
    images, labels, splits = _digits_arrays(str(folder.resolve()),
                                            labels_csv.stat().st_mtime_ns)
    if split is None:
        return images.copy(), labels.copy()
    keep = splits == split
    if not keep.any():
        raise DataError(f"{labels_csv}: the dataset is empty (0 rows in split {split!r}).")
    return images[keep], labels[keep]


def load_tabular_csv(path: str | Path, label_column: str = "target", split: str | None = None,
                     num_classes: int | None = None, *,
                     feature_columns: Sequence[str] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A numeric CSV read with pandas: ``(features float32 [N, F], labels int64 [N])``.

    ``feature_columns`` names the features, in order; None means every column except
    ``label_column`` and ``split``, and then a first column with an empty header (the
    row numbers pandas' ``df.to_csv(path)`` writes without ``index=False``) is refused.
    Labels may be written ``3`` or ``3.0``. Raises :class:`DataError` naming the file
    and line for ragged rows, NaN/inf or missing values, non-numeric features, missing,
    non-integer or out-of-range labels (``< 0``, or ``>= num_classes`` if given; without
    ``num_classes`` the labels must be the classes 0..K-1, so a regression target is refused),
    naming the file for unknown column names or an empty (split of the) file. Blank lines
    are skipped but counted in line numbers.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found.")
    table, lines = _read_csv(path)
    if label_column not in table.columns:
        raise DataError(f"{path}: no label column {label_column!r} "
                        f"(columns: {list(table.columns)}).")
    cols = _feature_columns(list(table.columns), path, label_column, feature_columns)
    table = _select_split(table, path, split)
    lines = lines[table.index.to_numpy()]  # read_csv numbers the rows 0..N-1
    features = _numeric_features(table, cols, lines, path)
    labels = _integer_labels(table[label_column], lines, path, label_column)
    _check_label_range(labels, lines, num_classes, path)
    return features, labels


def _feature_columns(columns: list[str], path: Path, label_column: str,
                     feature_columns: Sequence[str] | None) -> list[str]:
    if feature_columns is None:
        if str(columns[0]) in ("", "Unnamed: 0"):
            raise DataError(
                f"{path}: the first column has no header; it looks like a pandas index "
                "column (row numbers written by df.to_csv(path)), not a feature. Write the "
                "file with df.to_csv(path, index=False), or pass feature_columns=[...].")
        cols = [c for c in columns if c not in (label_column, "split")]
    elif isinstance(feature_columns, str):
        raise DataError(f"feature_columns must be a list of column names, got the string "
                        f"{feature_columns!r}.")
    else:
        cols = list(feature_columns)
        unknown = [c for c in cols if c not in columns]
        if unknown:
            raise DataError(f"{path}: no column(s) {unknown} (named in feature_columns); the "
                            f"columns are {columns}.")
        if label_column in cols:
            raise DataError(f"{path}: feature_columns includes the label column "
                            f"{label_column!r}.")
    if not cols:
        raise DataError(f"{path}: no feature columns (columns: {columns}).")
    return cols


def _numeric_features(table: pd.DataFrame, cols: list[str], lines: np.ndarray,
                      path: Path) -> np.ndarray:
    """``table[cols]`` as float32; :class:`DataError` naming the line of the first
    non-numeric, missing, NaN or infinite value."""
    for c in cols:
        if table[c].dtype.kind not in "iuf":
            bad = (pd.to_numeric(table[c], errors="coerce").isna() & table[c].notna())
            i = int(np.flatnonzero(bad.to_numpy())[0]) if bad.any() else 0
            raise DataError(f"{path}: line {lines[i]}: column {c!r} is not numeric (dtype "
                            f"{table[c].dtype}, value {table[c].iloc[i]!r}).")
    features = table[cols].to_numpy(np.float32)
    bad = ~np.isfinite(features).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        col = cols[int(np.flatnonzero(~np.isfinite(features[i]))[0])]
        raise DataError(f"{path}: line {lines[i]} has a NaN, infinite or missing value in "
                        f"column {col!r}.")
    return features
