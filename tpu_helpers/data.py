"""Datasets that feed a TPU well: checked on the host, fixed shapes, sharded exactly once.

Taught in ``notebooks/01_dataset_setup.ipynb``; ``notebooks/02_parallel_loader.ipynb``
wraps these loaders in ``MpDeviceLoader``; notebooks 03-06 and the benchmarks load the
shipped digits with :func:`load_digits`.

* Data: :func:`data_dir` (the repo's ``data/`` or ``$TPU_NB_DATA``), :func:`load_digits`
  (the shipped 8x8 digits as arrays), :func:`load_tabular_csv` (a CSV read with pandas),
  :class:`ImageFolderDataset` (PNG/JPEG files decoded with PIL, the seed article's
  ``CustomImageDataset`` done right), :class:`ArrayDataset` (in-memory numpy storage that
  forked processes share instead of copying).
* Fixed shapes: :func:`make_train_loader` (``DistributedSampler`` + ``drop_last``) and
  :func:`make_eval_loader` (padding rows with ``index`` and ``mask``, planned by the pure
  :func:`eval_shard_indices`), so XLA compiles one graph and every replica runs the same
  number of steps.

Every check raises :class:`DataError` (a ``ValueError``) naming the file, line or index,
on the host, before anything is sent to the XLA device. Importing this module does not
touch the XLA device; only the loader functions called without ``world_size``/``rank``
ask ``torch_xla.runtime`` for them.
"""

from __future__ import annotations

import csv
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

if TYPE_CHECKING:
    import pandas as pd

#: Mean and standard deviation of ``png / 255`` over the digits training split.
DIGITS_MEAN = 0.3054
DIGITS_STD = 0.3760
NUM_DIGIT_CLASSES = 10
SPLITS = ("train", "test")


class DataError(ValueError):
    """Bad input data, explained in one sentence that names the file, line or index."""


# --------------------------------------------------------------------------- where



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
    import importlib.util

    spec = importlib.util.find_spec("tpu_notebooks_data")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise DataError(f"no data folder: {repo} does not exist and the tpu_notebooks_data package "
                    "(in the tpu_helpers wheel) is not installed; set TPU_NB_DATA to a folder "
                    "laid out like the repository's data/.")


# --------------------------------------------------------------------------- checks


def check_finite(features: np.ndarray, source: str = "features") -> None:
    """Raise :class:`DataError` naming the first row with a NaN or infinite value."""
    if features.dtype.kind not in "fc":
        return
    bad = ~np.isfinite(features.reshape(len(features), -1)).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise DataError(
            f"{source}: row {rows[0]} has NaN or infinite values "
            f"({len(rows)} bad row(s), first ones: {rows[:5].tolist()})."
        )


def check_labels(labels: np.ndarray, num_classes: int | None, source: str = "labels") -> None:
    """Raise :class:`DataError` naming the first label that is not an integer in range."""
    if labels.ndim != 1:
        raise DataError(f"{source}: labels must be one-dimensional, got shape {labels.shape}.")
    if labels.dtype.kind not in "iu":
        raise DataError(f"{source}: labels must be integers, got dtype {labels.dtype}.")
    low = 0
    bad = labels < low
    if num_classes is not None:
        bad |= labels >= num_classes
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        rng = f"0..{num_classes - 1}" if num_classes is not None else ">= 0"
        raise DataError(f"{source}: label {int(labels[i])} at index {i} is out of range {rng}.")


def _stack_rows(rows: Any, what: str) -> np.ndarray:
    """np.asarray that names the first ragged row instead of numpy's generic message."""
    if isinstance(rows, np.ndarray):
        return rows
    if isinstance(rows, torch.Tensor):
        return rows.detach().cpu().numpy()
    if isinstance(rows, Sequence) and not isinstance(rows, str | bytes):
        if len(rows) and all(isinstance(r, Sequence | np.ndarray | torch.Tensor) for r in rows):
            first = np.shape(rows[0])
            for i, r in enumerate(rows):
                try:
                    shape = np.shape(r)
                except ValueError:  # the row itself is ragged
                    shape = None
                if shape != first:
                    raise DataError(
                        f"{what}: row {i} has shape {shape}, row 0 has {first} "
                        "(ragged rows; every sample must have the same shape)."
                    )
    return np.asarray(rows)


# --------------------------------------------------------------------------- arrays


class ArrayDataset(Dataset):
    """In-memory samples in one numpy array per field: ``(x, y)`` tensors per index.

    Storage stays numpy (one buffer, no per-sample Python objects), so processes forked
    after building it share the pages instead of copying them (notebook 01 measures it).
    ``x`` is returned as a tensor view of that buffer; the DataLoader's collate copies
    it into the batch. Checks on construction: same length, not empty, same shape for
    every row, finite features, integer labels (in ``0..num_classes-1`` if given).
    """

    def __init__(self, images: Any, labels: Any, num_classes: int | None = None) -> None:
        x = _stack_rows(images, "images")
        y = _stack_rows(labels, "labels")
        if len(x) == 0:
            raise DataError("ArrayDataset: the dataset is empty (0 samples).")
        if len(x) != len(y):
            raise DataError(f"ArrayDataset: {len(x)} images but {len(y)} labels.")
        if x.dtype.kind == "f" and x.dtype != np.float32:
            x = x.astype(np.float32)
        if y.dtype.kind in "iu" and y.dtype != np.int64:
            y = y.astype(np.int64)
        check_finite(x, "ArrayDataset images")
        check_labels(y, num_classes, "ArrayDataset labels")
        self.images = x
        self.labels = y

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.images[index]), torch.tensor(self.labels[index])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A whole batch with one numpy gather (the DataLoader uses it when present):
        about 2.5x less host time per batch than 64 ``__getitem__`` calls."""
        rows = np.asarray(indices, dtype=np.int64)
        x = torch.from_numpy(self.images[rows])
        y = torch.from_numpy(self.labels[rows])
        return list(zip(x.unbind(0), y.unbind(0), strict=True))


# --------------------------------------------------------------------------- files


def decode_image(path: str | Path, size: tuple[int, int] | None = (8, 8),
                 mode: str | None = "L") -> np.ndarray:
    """Decode one image file to a ``uint8`` array ``[H, W]`` (mode L) or ``[H, W, C]``.

    Raises :class:`DataError` naming the file when it is missing, not an image,
    truncated or corrupt, or has another ``(height, width)`` or mode than asked, or
    declares more pixels than PIL's ``Image.MAX_IMAGE_PIXELS`` (a decompression bomb).
    Mode, size and pixel count are checked from the header, before any pixel is decoded.
    """
    from PIL import Image, UnidentifiedImageError

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
    from PIL import Image

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
    import pandas as pd

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
    import pandas as pd

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
    """Labels are ``>= 0`` (and ``< num_classes`` if given), like :func:`check_labels`."""
    bad = labels < 0
    if num_classes is not None:
        bad |= labels >= num_classes
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        rng = f"0..{num_classes - 1}" if num_classes is not None else ">= 0"
        where = f" ({files[i]})" if files is not None else ""
        raise DataError(f"{path}: line {lines[i]}{where}: label {labels[i]} is out of "
                        f"range {rng}.")


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

    The seed article's ``CustomImageDataset`` done right: every file is decoded and
    checked once on construction (``verify=True``), so a missing, corrupt, truncated,
    wrong-size or wrong-mode file, or a label out of range, is a :class:`DataError`
    naming the file before any training starts, not a crash in a DataLoader worker
    mid-epoch or a recompile from an odd shape. Items are ``(x, y)`` with ``x`` float32
    ``[C, H, W]`` normalised as ``(pixel / 255 - mean) / std`` and ``y`` an int64 scalar.
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
    import pandas as pd

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
    non-integer or out-of-range labels (``< 0``, or ``>= num_classes`` if given), and
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
    import pandas as pd

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


# --------------------------------------------------------------------------- loaders


def _replica(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        import torch_xla.runtime as xr

        world_size = xr.world_size() if world_size is None else world_size
        rank = xr.global_ordinal() if rank is None else rank
    if world_size < 1:
        raise DataError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in 0..{world_size - 1}.")
    return int(world_size), int(rank)


def _check_batch(n: int, batch_size: int) -> None:
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}.")
    if n == 0:
        raise DataError("the dataset is empty (0 samples): nothing to load.")


def train_steps_per_epoch(n: int, batch_size: int, world_size: int) -> int:
    """Full batches each replica runs per epoch under :func:`make_train_loader`."""
    return math.ceil(n / world_size) // batch_size


def make_train_loader(dataset: Dataset, batch_size: int, *, world_size: int | None = None,
                      rank: int | None = None, seed: int = 0,
                      num_workers: int = 0) -> DataLoader:
    """A training DataLoader with one fixed batch shape, sharded across replicas.

    ``DistributedSampler(num_replicas=world_size, rank=rank, shuffle=True, seed=seed)``
    (defaults ``xr.world_size()`` / ``xr.global_ordinal()``) gives every replica
    ``ceil(N / world_size)`` indices (repeating a few to make it divide), and
    ``drop_last=True`` drops the partial last batch, so every step has exactly
    ``batch_size`` rows and every replica runs the same number of steps. Call
    ``loader.sampler.set_epoch(epoch)`` each epoch for a new shuffle.

    Batches are ``default_collate``'s, after a check that every item has the shapes and
    dtypes of the batch's first one (:class:`DataError` naming both dataset indices).
    ``loader.dataset`` is a thin wrapper that remembers the indices (``.dataset`` is
    yours). Raises :class:`DataError` if a replica cannot get one full batch.
    """
    ws, rk = _replica(world_size, rank)
    n = len(dataset)
    _check_batch(n, batch_size)
    per_replica = math.ceil(n / ws)
    if per_replica < batch_size:
        raise DataError(
            f"training set too small: {n} samples over {ws} replica(s) gives each "
            f"{per_replica} sample(s), fewer than one batch of {batch_size}; use "
            f"batch_size <= {per_replica}, more data, or fewer replicas "
            "(evaluation still works: make_eval_loader pads and masks)."
        )
    sampler = DistributedSampler(dataset, num_replicas=ws, rank=rk, shuffle=True, seed=seed)
    return DataLoader(_IndexedItems(dataset), batch_size=batch_size, sampler=sampler,
                      drop_last=True, num_workers=num_workers, collate_fn=_collate_train)


def eval_shard_indices(n: int, batch_size: int, world_size: int, rank: int) -> np.ndarray:
    """The dataset indices replica ``rank`` evaluates, in order; ``-1`` marks padding.

    The indices ``0..n-1`` are padded with ``-1`` up to a multiple of
    ``batch_size * world_size`` and dealt out round-robin (like ``DistributedSampler``
    with ``shuffle=False``, but padding instead of repeating). So every replica gets the
    same number of full batches, and each index appears on exactly one replica, once.
    Pure: no torch_xla, no I/O.
    """
    _check_batch(n, batch_size)
    _replica(world_size, rank)
    steps = math.ceil(n / (batch_size * world_size))
    padded = np.full(steps * batch_size * world_size, -1, dtype=np.int64)
    padded[:n] = np.arange(n, dtype=np.int64)
    return padded[rank::world_size].copy()


class PaddedEvalDataset(Dataset):
    """Wraps a ``(x, y)`` dataset: item ``i`` is ``(x, y, i, True)``; item ``-1`` is a
    padding row ``(zeros like x, zeros like y, -1, False)``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._padding: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def _pad_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._padding is None:
            x, y = self.dataset[0]
            self._padding = (torch.zeros_like(torch.as_tensor(x)),
                             torch.zeros_like(torch.as_tensor(y)))
        return self._padding

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index < 0:
            x, y = self._pad_row()
            return x, y, torch.tensor(-1, dtype=torch.int64), torch.tensor(False)
        x, y = self.dataset[index]
        return (torch.as_tensor(x), torch.as_tensor(y), torch.tensor(index, dtype=torch.int64),
                torch.tensor(True))


def make_eval_loader(dataset: Dataset, batch_size: int, *, world_size: int | None = None,
                     rank: int | None = None, num_workers: int = 0) -> DataLoader:
    """An evaluation DataLoader yielding ``(x, y, index, mask)``, every batch full.

    ``index`` (int64) is each row's dataset index, ``-1`` on padding rows; ``mask``
    (bool) is True on real rows. Every replica runs the same number of steps and, across
    replicas, each dataset index is in exactly one unmasked row (see
    :func:`eval_shard_indices`). Works for any non-empty dataset, even one smaller than
    a batch per replica. Reduce metrics with the mask; gather predictions with the index.

    Batches are ``default_collate``'s, after a check that every row's ``x`` and ``y``
    have the shapes and dtypes of the batch's first real row: an odd item is a
    :class:`DataError` naming its dataset index and both shapes (with worker processes
    too), not a bare "stack expects each tensor to be equal size".
    """
    ws, rk = _replica(world_size, rank)
    indices = eval_shard_indices(len(dataset), batch_size, ws, rk)
    return DataLoader(PaddedEvalDataset(dataset), batch_size=batch_size,
                      sampler=indices.tolist(), shuffle=False, drop_last=False,
                      num_workers=num_workers, collate_fn=_collate_eval)


# --------------------------------------------------------------------------- collate
# Module-level functions (picklable for worker processes). The per-batch cost is one
# dtype scan, about as long as default_collate itself (~0.5 us per (x, y) item); shapes
# cost nothing extra: torch.stack compares them, and they are scanned only if it fails.


def _layout(item: Any, shapes: bool = True) -> Any:
    """What must match across one batch: the dtype (and shape if ``shapes``) of each
    tensor or array, the type of anything else, through tuples, lists and dicts."""
    if isinstance(item, tuple | list):  # the usual (x, y): no call per tensor
        return [((v.shape, v.dtype) if shapes else v.dtype) if isinstance(v, torch.Tensor)
                else _layout(v, shapes) for v in item]
    if isinstance(item, torch.Tensor | np.ndarray):
        return (item.shape, item.dtype) if shapes else item.dtype
    if isinstance(item, Mapping):
        return {k: _layout(v, shapes) for k, v in item.items()}
    return type(item).__name__


def _find_odd(items: Sequence[Any], ref: int, shapes: bool) -> int | None:
    want = _layout(items[ref], shapes)
    return next((i for i, item in enumerate(items) if _layout(item, shapes) != want), None)


def _describe_layout(layout: Any) -> str:
    if isinstance(layout, tuple):
        return f"shape {list(layout[0])} {layout[1]}"
    return f"the layout {layout}" if isinstance(layout, list | dict) else f"a {layout}"


def _odd_item(items: Sequence[Any], odd: int, ref: int,
              index_of: Callable[[int], Any]) -> DataError:
    """The error naming item ``odd``'s dataset index, its first differing field, and
    item ``ref``'s (the batch's first real item)."""
    got, want = _layout(items[odd]), _layout(items[ref])
    field = "the item"
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        i = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
        field = ("x", "y")[i] if len(got) == 2 else f"element {i}"
        got, want = got[i], want[i]
    index = index_of(odd)
    if index == -1:
        index = "-1 (a padding row, shaped like dataset index 0)"
    return DataError(
        f"dataset index {index}: {field} has {_describe_layout(got)}, but dataset index "
        f"{index_of(ref)} in the same batch has {_describe_layout(want)}; every item must "
        "have the same shapes and dtypes (fixed shapes: one XLA graph)."
    )


def _checked_collate(batch: list, items: Sequence[Any], ref: int,
                     index_of: Callable[[int], Any]) -> Any:
    """``default_collate(batch)`` once ``items`` (what must match, one per row) all have
    the layout of ``items[ref]``; :class:`DataError` naming the odd row otherwise."""
    odd = _find_odd(items, ref, shapes=False)  # dtypes first: torch.stack promotes them
    if odd is None:
        try:
            return default_collate(batch)
        except Exception as exc:  # torch.stack refuses unequal shapes: find the odd row
            odd = _find_odd(items, ref, shapes=True)
            if odd is None:
                raise
            raise _odd_item(items, odd, ref, index_of) from exc
    raise _odd_item(items, odd, ref, index_of)


def _collate_eval(batch: list[tuple]) -> Any:
    """make_eval_loader's collate of ``(x, y, index, mask)`` rows: ``x`` and ``y``
    checked against the first real (mask True) row's, then ``default_collate``."""
    ref = next((i for i, row in enumerate(batch) if row[3]), 0)
    return _checked_collate(batch, [row[:2] for row in batch], ref,
                            lambda i: int(batch[i][2]))


def _collate_train(batch: list) -> Any:
    """make_train_loader's collate: items checked against the first, then
    ``default_collate``; ``batch.indices`` (from :class:`_IndexedItems`) names them."""
    indices = getattr(batch, "indices", None)
    return _checked_collate(batch, batch, 0,
                            lambda i: indices[i] if indices else f"? (batch row {i})")


class _Batch(list):
    """A list of dataset items that knows their dataset indices."""

    def __init__(self, items: Sequence[Any], indices: Sequence[int]) -> None:
        super().__init__(items)
        self.indices = [int(i) for i in indices]


class _IndexedItems(Dataset):
    """``dataset``'s items, fetched a batch at a time (its own ``__getitems__`` if it
    has one) as a :class:`_Batch`, so the collate can name an odd item's index."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> _Batch:
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return _Batch(items, indices)
