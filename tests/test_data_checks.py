"""Inputs users tried that the other data tests do not pick (one test per case).

Valid files that used to be refused (blank lines, ``1.0`` labels), raw errors that now
name the file and line or the dataset index (empty ``file`` cell, decompression bombs,
string labels, one odd-shaped item in a batch), and files that used to be accepted
silently (duplicate images, conflicting labels, ``-1`` labels, a pandas index column).
Real files in ``tmp_path``, real PIL, real DataLoaders (also with worker processes).
"""

from __future__ import annotations

import shutil
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_python
from PIL import Image, ImageFile
from torch.utils.data import Dataset, default_collate

from course import datasets as DS
from tpu_helpers import data as D

HEADER = "file,label,split"


def _folder(tmp_path: Path, rows: list[str], text: str | None = None, n: int = 6) -> Path:
    """Real digit PNGs ``images/0000.png``.. and a labels.csv of ``rows`` (or ``text``)."""
    src = DS.data_dir() / "digits"
    dst = tmp_path / "digits"
    (dst / "images").mkdir(parents=True)
    for i in range(n):
        shutil.copy(src / "images" / f"{i:04d}.png", dst / "images" / f"{i:04d}.png")
    (dst / "labels.csv").write_bytes(
        (text if text is not None else "\n".join([HEADER, *rows]) + "\n").encode())
    return dst


def _rows(n: int = 6) -> list[str]:
    return [f"images/{i:04d}.png,{i % 10},{'test' if i % 3 == 0 else 'train'}"
            for i in range(n)]


# --------------------------------------------------------------------------- 1. valid files


@pytest.mark.parametrize("text", [
    "\n".join([HEADER, *_rows()]) + "\n\n",            # a trailing blank line
    "\r\n".join([HEADER, *_rows()]) + "\r\n\r\n",      # Windows line endings + blank line
    "\n".join([HEADER, *_rows()[:3], "", *_rows()[3:]]) + "\n",  # blank line in the middle
], ids=["trailing-blank", "crlf", "blank-in-middle"])
def test_blank_lines_in_labels_csv_are_accepted(tmp_path, text):
    ds = DS.ImageFolderDataset(_folder(tmp_path, [], text=text))
    assert len(ds) == 6 and ds.labels.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("text", [
    "a,b,target\n1,2,0\n3,4,1\n\n",
    "a,b,target\r\n1,2,0\r\n3,4,1\r\n\r\n",
    "a,b,target\n1,2,0\n   \n3,4,1\n",  # whitespace-only: pandas skips it too
], ids=["trailing-blank", "crlf", "whitespace-line"])
def test_blank_lines_in_tabular_csv_are_accepted(tmp_path, text):
    path = tmp_path / "t.csv"
    path.write_bytes(text.encode())
    x, y = DS.load_tabular_csv(path)
    assert x.tolist() == [[1, 2], [3, 4]] and y.tolist() == [0, 1]


def test_blank_lines_in_the_middle_keep_line_numbers_right(tmp_path):
    """Blank lines are skipped (like pandas) but counted: later errors name the real line."""
    path = tmp_path / "t.csv"
    path.write_text("a,b,target\n1,2,0\n\n\n3,4\n")  # the short row is on line 5
    with pytest.raises(D.DataError, match=r"t\.csv: line 5 has 2 fields, the header has 3"):
        DS.load_tabular_csv(path)
    path.write_text("a,b,target\n1,2,0\n\n3,,1\n")  # the missing value is on line 4
    with pytest.raises(D.DataError, match=r"t\.csv: line 4 has a NaN.*column 'b'"):
        DS.load_tabular_csv(path)
    path.write_text("a,b,target\n\n1,2,0\n3,4,7\n")
    with pytest.raises(D.DataError, match=r"t\.csv: line 4: label 7 is out of range 0\.\.1"):
        DS.load_tabular_csv(path, num_classes=2)
    path.write_text('name,a,target\n"two\nlines",1,0\n\nz,2,\n')  # a quoted newline
    with pytest.raises(D.DataError, match=r"t\.csv: line 5: label column 'target' must hold "
                                          r"integers, got a missing value"):
        DS.load_tabular_csv(path, feature_columns=["a"])
    rows = _rows()
    rows[4] = rows[4].replace(",4,", ",14,")
    text = "\n".join([HEADER, *rows[:2], "", "", *rows[2:]]) + "\n"
    folder = _folder(tmp_path, [], text=text)
    table = DS.read_labels_csv(folder / "labels.csv")
    assert table["line"].tolist() == [2, 3, 6, 7, 8, 9]
    with pytest.raises(D.DataError, match=r"line 8 \(images/0004\.png\): label 14 is out"):
        DS.ImageFolderDataset(folder)


def test_integral_float_labels_are_int_labels(tmp_path):
    rows = [r.replace(f",{i},", f",{i}.0,") for i, r in enumerate(_rows())]
    folder = _folder(tmp_path, rows)
    table = DS.read_labels_csv(folder / "labels.csv", num_classes=10)
    assert table["label"].dtype == np.int64 and table["label"].tolist() == list(range(6))
    ds = DS.ImageFolderDataset(folder)
    assert ds.labels.tolist() == list(range(6)) and ds[3][1].dtype == torch.int64
    path = tmp_path / "t.csv"
    path.write_text("a,target\n1,0.0\n2,1.0\n3,2.0\n")
    x, y = DS.load_tabular_csv(path, num_classes=3)
    assert y.dtype == np.int64 and y.tolist() == [0, 1, 2]


@pytest.mark.parametrize(("value", "message"), [
    ("1.5", r"line 4: label column 'label' must hold integers, got 1\.5"),
    ("", r"line 4: label column 'label' must hold integers, got a missing value"),
])
def test_non_integral_or_missing_label_names_its_line(tmp_path, value, message):
    rows = [r.replace(f",{i},", f",{i}.0,") for i, r in enumerate(_rows())]
    rows[2] = f"images/0002.png,{value},train"  # line 4; every other line is valid
    folder = _folder(tmp_path, rows)
    with pytest.raises(D.DataError, match=r"labels\.csv: " + message):
        DS.read_labels_csv(folder / "labels.csv")
    path = tmp_path / "t.csv"
    path.write_text(f"a,label\n1,0.0\n2,1.0\n3,{value}\n4,2.0\n")
    with pytest.raises(D.DataError, match=r"t\.csv: " + message):
        DS.load_tabular_csv(path, label_column="label")


# --------------------------------------------------------------------------- 2. raw errors


def test_empty_file_cell_names_line(tmp_path):
    rows = _rows()
    rows[3] = ",3,train"  # line 5
    folder = _folder(tmp_path, rows)
    with pytest.raises(D.DataError, match=r"labels\.csv: line 5 has no file name"):
        DS.ImageFolderDataset(folder)


def test_string_label_names_line(tmp_path):
    rows = _rows()
    rows[4] = "images/0004.png,cat,train"  # line 6
    folder = _folder(tmp_path, rows)
    with pytest.raises(D.DataError, match=r"labels\.csv: line 6: label column 'label' must "
                                          r"hold integers, got 'cat'"):
        DS.ImageFolderDataset(folder)
    path = tmp_path / "t.csv"
    path.write_text("a,target\n1,0\n2,dog\n")
    with pytest.raises(D.DataError, match=r"t\.csv: line 3: .* got 'dog'"):
        DS.load_tabular_csv(path)


def _write_bomb_png(path: Path, width: int, height: int) -> None:
    """A complete, valid 1-bit greyscale PNG of ``width x height`` zero pixels, written a
    band of rows at a time: a few KB on disk and little memory, however big it declares."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    comp, idat = zlib.compressobj(9), []
    for start in range(0, height, 1000):
        idat.append(comp.compress(row * min(1000, height - start)))
    idat.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                     + chunk(b"IDAT", b"".join(idat)) + chunk(b"IEND", b""))


@pytest.fixture
def no_decoding(monkeypatch):
    """Make decoding a huge image fail the test: a bomb must be refused from its header."""
    real_load = ImageFile.ImageFile.load

    def load(self):
        if self.size[0] * self.size[1] > Image.MAX_IMAGE_PIXELS:
            raise AssertionError(f"decoded {self.size} pixels")
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


@pytest.mark.parametrize("side", [20000, 10000], ids=["over-2x-limit", "over-1x-limit"])
@pytest.mark.parametrize("warning_filter", ["default", "error", "ignore"])
def test_decompression_bomb_is_refused_naming_the_file(tmp_path, no_decoding, side,
                                                       warning_filter):
    assert side * side > Image.MAX_IMAGE_PIXELS  # 20000**2 is over twice the limit
    path = tmp_path / "bomb.png"
    _write_bomb_png(path, side, side)
    assert path.stat().st_size < 100_000
    with warnings.catch_warnings():
        warnings.simplefilter(warning_filter)
        with pytest.raises(D.DataError, match=r"bomb\.png: .*decompression bomb"):
            DS.decode_image(path, size=None, mode=None)
        with pytest.raises(D.DataError, match=r"bomb\.png: .*decompression bomb"):
            DS.decode_image(path)  # expected 8x8 L


def test_decompression_bomb_in_a_folder_names_the_file(tmp_path, no_decoding):
    folder = _folder(tmp_path, _rows())
    _write_bomb_png(folder / "images" / "0003.png", 20000, 20000)
    with pytest.raises(D.DataError, match=r"0003\.png: .*decompression bomb"):
        DS.ImageFolderDataset(folder)


class OddItem(Dataset):
    """10 items ``(x float32 [4], y int64)``; item ``bad`` has ``x`` of shape [3]
    (or another dtype)."""

    def __init__(self, bad: int = 7, dtype: torch.dtype | None = None) -> None:
        self.bad, self.dtype = bad, dtype

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i))
        if i == self.bad:
            x = x.to(self.dtype) if self.dtype is not None else x[:3]
        return x, torch.tensor(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_odd_item_in_eval_loader_names_its_index(num_workers):
    loader = D.make_eval_loader(OddItem(7), 4, world_size=1, rank=0, num_workers=num_workers)
    loader.timeout = 60 if num_workers else 0
    with pytest.raises(D.DataError, match=r"dataset index 7: x has shape \[3\] torch\.float32"
                                          r".*dataset index 4 .*shape \[4\] torch\.float32"):
        list(loader)


def test_odd_dtype_in_eval_loader_names_its_index():
    loader = D.make_eval_loader(OddItem(5, torch.float64), 4, world_size=1, rank=0)
    with pytest.raises(D.DataError, match=r"dataset index 5: x has shape \[4\] torch\.float64"):
        list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_odd_item_in_train_loader_names_its_index(num_workers):
    # 2 batches of 5, one per worker: with a single batch, the idle worker's queue is torn down
    # after the error by PyTorch's DataLoader with "Exception in thread QueueFeederThread" (a
    # shutdown race in torch.utils.data, reproduced with a plain DataLoader, not this toolkit)
    loader = D.make_train_loader(OddItem(7), 5, world_size=1, rank=0,
                                 num_workers=num_workers)
    loader.timeout = 60 if num_workers else 0
    with pytest.raises(D.DataError, match=r"dataset index 7: x has shape \[3\]"):
        list(loader)
    x, y = DS.load_digits("test")  # ArrayDataset's batched __getitems__ still works
    ds = D.ArrayDataset(x, y)
    (xb, yb), *_ = D.make_train_loader(ds, 64, world_size=1, rank=0, num_workers=num_workers)
    idx = list(D.make_train_loader(ds, 64, world_size=1, rank=0).sampler)[:64]
    assert torch.equal(xb, torch.from_numpy(x[idx])) and torch.equal(yb, torch.from_numpy(y[idx]))


def test_checking_collate_keeps_the_default_format():
    """Same tensors, dtypes and shapes as default_collate of the padded rows."""
    ds = OddItem(bad=-5)  # every item fine
    loader = D.make_eval_loader(ds, 8, world_size=2, rank=1)  # global 8: 4 per replica
    padded = D.PaddedEvalDataset(ds)
    for got, idx in zip(loader, np.reshape(D.replica_eval_indices(10, 4, 2, 1), (-1, 4)),
                        strict=True):
        want = default_collate([padded[int(i)] for i in idx])
        assert isinstance(got, list) and len(got) == 4
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)


PREDICT_ODD = """
import torch, torch_xla
from tpu_helpers.data import DataError, make_eval_loader
from tpu_helpers.predict import predict

class OddItem(torch.utils.data.Dataset):
    def __init__(self, bad):
        self.bad = bad
    def __len__(self):
        return 10
    def __getitem__(self, i):
        x = torch.full((4,), float(i))
        return (x[:3] if i == self.bad else x), torch.tensor(i)

torch.manual_seed(0)
model = torch.nn.Linear(4, 2).to(torch_xla.device())
for bad in (7, 2):  # in batch 1 (after a step ran), in batch 0 (before any)
    try:
        predict(model, make_eval_loader(OddItem(bad), 4))
    except DataError as exc:
        print("DataError:", exc)
"""


def test_predict_with_an_odd_item_raises_data_error_naming_the_index():
    # A fresh process: loader threads other tests leave behind in a long-lived test process
    # once took torch_xla 2.8 down (an abort while garbage-collecting in one of them).
    proc = run_python(PREDICT_ODD)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DataError:")]
    assert len(lines) == 2, proc.stdout
    for bad, line in zip((7, 2), lines, strict=True):
        assert f"dataset index {bad}: x has shape [3]" in line


# --------------------------------------------------------------------------- 3. refused now


@pytest.mark.parametrize("second", ["images/0001.png,1,train", "images/0001.png,1,test",
                                    "./images//0001.png,1,train"],
                         ids=["same-split", "other-split", "same-path-spelt-otherwise"])
def test_same_image_listed_twice_names_both_lines(tmp_path, second):
    rows = _rows()
    rows.append(second)  # line 8; the first listing is line 3
    folder = _folder(tmp_path, rows)
    with pytest.raises(D.DataError, match=r"labels\.csv: line 8 lists images/0001\.png again "
                                          r"\(first on line 3\)"):
        DS.ImageFolderDataset(folder, "train")


def test_same_image_with_two_labels_is_a_conflict(tmp_path):
    rows = _rows()
    rows.insert(4, "images/0001.png,7,test")  # line 6; first listed on line 3 with label 1
    folder = _folder(tmp_path, rows)
    with pytest.raises(D.DataError, match=r"labels\.csv: conflicting labels for "
                                          r"images/0001\.png: 1 on line 3, 7 on line 6"):
        DS.read_labels_csv(folder / "labels.csv")


def test_negative_label_without_num_classes_is_refused(tmp_path):
    rows = _rows()
    rows[1] = "images/0001.png,-1,train"  # line 3
    folder = _folder(tmp_path, rows)
    with pytest.raises(D.DataError, match=r"labels\.csv: line 3 \(images/0001\.png\): label -1 "
                                          r"is out of range >= 0"):
        DS.read_labels_csv(folder / "labels.csv")
    with pytest.raises(D.DataError, match=r"line 3 \(images/0001\.png\): label -1"):
        DS.ImageFolderDataset(folder, num_classes=None)
    path = tmp_path / "t.csv"
    path.write_text("a,target\n1,0\n2,-1\n")
    with pytest.raises(D.DataError, match=r"t\.csv: line 3: label -1 is out of range >= 0"):
        DS.load_tabular_csv(path)


def _pandas_csv(path: Path, **to_csv) -> None:
    import pandas as pd

    pd.DataFrame({"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "target": [0, 1, 0],
                  "split": ["train", "test", "train"]}).to_csv(path, **to_csv)


def test_pandas_index_column_is_refused(tmp_path):
    path = tmp_path / "p.csv"
    _pandas_csv(path)  # df.to_csv(path): an unnamed first column 0..N-1
    with pytest.raises(D.DataError, match=r"p\.csv: .*pandas index column.*index=False.*"
                                          r"feature_columns="):
        DS.load_tabular_csv(path)
    _pandas_csv(path, index=False)
    x, y = DS.load_tabular_csv(path)
    assert x.tolist() == [[1, 4], [2, 5], [3, 6]] and y.tolist() == [0, 1, 0]


def test_feature_columns_choose_and_order_the_features(tmp_path):
    path = tmp_path / "p.csv"
    _pandas_csv(path)  # with the index column: not used when feature_columns is given
    x, y = DS.load_tabular_csv(path, feature_columns=["b", "a"], split="train")
    assert x.dtype == np.float32 and x.tolist() == [[4, 1], [6, 3]] and y.tolist() == [0, 0]
    x, _ = DS.load_tabular_csv(path, feature_columns=("a",))
    assert x.shape == (3, 1)


def test_unknown_feature_columns_list_the_available_ones(tmp_path):
    path = tmp_path / "p.csv"
    _pandas_csv(path, index=False)
    with pytest.raises(D.DataError, match=r"p\.csv: no column\(s\) \['c'\].*"
                                          r"\['a', 'b', 'target', 'split'\]"):
        DS.load_tabular_csv(path, feature_columns=["a", "c"])


def test_a_regression_target_is_not_loaded_as_classes(tmp_path):
    # integral targets 25..346 (a regression dataset): 322 "classes" before, silently
    path = tmp_path / "diabetes.csv"
    rows = "\n".join(f"{v / 100},{v}" for v in range(25, 347))
    path.write_text("bmi,target\n" + rows + "\n")
    with pytest.raises(D.DataError, match=r"diabetes\.csv: the labels hold 322 distinct values "
                                          r"in 25\.\.346, not the classes 0\.\.K-1 \(25 of "
                                          r"0\.\.346 never occur\): a regression target\?"):
        DS.load_tabular_csv(path)
    x, y = DS.load_tabular_csv(path, num_classes=347)  # class ids, said explicitly
    assert y.min() == 25 and len(y) == 322
    path.write_text("a,target\n1,0\n2,2\n3,1\n")  # 0..K-1, each present
    assert DS.load_tabular_csv(path)[1].tolist() == [0, 2, 1]


def test_the_scripts_npz_labels_must_be_class_ids(tmp_path):
    """``python -m tpu_helpers.train --data f.npz``: y must be class ids 0..K-1 (whole floats
    pass), not a regression target."""
    def npz(y):
        np.savez(tmp_path / "y.npz", x=np.zeros((len(y), 2)), y=y)
        return str(tmp_path / "y.npz")

    assert D.load_npz(npz(np.array([2, 0, 1])))[1].tolist() == [2, 0, 1]
    x, y = D.load_npz(npz(np.array([1.0, 0.0])))
    assert y.dtype == np.int64 and x.dtype == np.float32
    with pytest.raises(ValueError, match=r"y\.npz: y: the labels hold 322 distinct values in "
                                         r"25\.\.346, not the classes 0\.\.K-1 .*a regression"):
        D.load_npz(npz(np.arange(25, 347)))
