"""Bad input: each case is a clear DataError naming the file, line or index, on the host.

Real files in tmp_path, real PIL decoding, real DataLoaders (also with worker processes).
None of these paths imports torch_xla (checked last), so nothing can be compiled or hang.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from course import datasets as DS
from tpu_helpers import data as D


def _folder(tmp_path: Path, n: int = 6, rows: list[str] | None = None) -> Path:
    """A small image folder copied from the shipped digits (real PNGs)."""
    src = DS.data_dir() / "digits"
    dst = tmp_path / "digits"
    (dst / "images").mkdir(parents=True)
    lines = ["file,label,split"]
    for i in range(n):
        shutil.copy(src / "images" / f"{i:04d}.png", dst / "images" / f"{i:04d}.png")
        lines.append(f"images/{i:04d}.png,{i % 10},{'test' if i % 3 == 0 else 'train'}")
    (dst / "labels.csv").write_text("\n".join(rows if rows is not None else lines) + "\n")
    return dst


def test_good_folder_loads(tmp_path):
    ds = DS.ImageFolderDataset(_folder(tmp_path))
    assert len(ds) == 6 and ds[5][0].shape == (1, 8, 8)


def test_corrupt_image_names_file(tmp_path):
    folder = _folder(tmp_path)
    (folder / "images" / "0003.png").write_bytes(b"this is not a png at all" * 4)
    with pytest.raises(D.DataError, match=r"0003\.png: not a readable image"):
        DS.ImageFolderDataset(folder)


def test_truncated_image_names_file(tmp_path):
    folder = _folder(tmp_path)
    p = folder / "images" / "0002.png"
    p.write_bytes(p.read_bytes()[:70])  # header intact, pixel data cut off
    with pytest.raises(D.DataError, match=r"0002\.png: corrupt or truncated"):
        DS.ImageFolderDataset(folder)


def test_missing_file_names_file_and_csv_line(tmp_path):
    folder = _folder(tmp_path)
    (folder / "images" / "0004.png").unlink()
    with pytest.raises(D.DataError, match=r"0004\.png: file not found \(named on line 6"):
        DS.ImageFolderDataset(folder)
    with pytest.raises(D.DataError, match="labels file not found"):
        DS.ImageFolderDataset(tmp_path / "elsewhere")


def test_label_out_of_range_names_line(tmp_path):
    folder = _folder(tmp_path)
    lines = (folder / "labels.csv").read_text().splitlines()
    lines[3] = lines[3].replace(",2,", ",12,")
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(D.DataError, match=r"line 4 \(images/0002\.png\): label 12 is out of"):
        DS.ImageFolderDataset(folder)
    with pytest.raises(D.DataError, match=r"label 10 at index 1 is out of range 0\.\.9"):
        D.ArrayDataset(np.zeros((3, 2), np.float32), [0, 10, 1], num_classes=10)
    with pytest.raises(D.DataError, match=r"label -1 at index 2"):
        D.ArrayDataset(np.zeros((3, 2), np.float32), [0, 1, -1])


@pytest.mark.parametrize(("size", "mode", "message"), [
    ((9, 8), "L", r"0001\.png: image size 8x9 \(HxW\), expected 8x8"),
    ((8, 8), "RGB", r"0001\.png: image mode 'RGB', expected 'L'"),
])
def test_wrong_size_or_mode_names_file(tmp_path, size, mode, message):
    folder = _folder(tmp_path)
    Image.new(mode, size).save(folder / "images" / "0001.png")
    with pytest.raises(D.DataError, match=message):
        DS.ImageFolderDataset(folder)


def test_nan_and_inf_features_name_the_row(tmp_path):
    x = np.ones((5, 3), np.float32)
    x[3, 1] = np.nan
    with pytest.raises(D.DataError, match="row 3 has NaN or infinite"):
        D.ArrayDataset(x, np.zeros(5, np.int64))
    x[3, 1] = 1
    x[1, 0] = np.inf
    with pytest.raises(D.DataError, match="row 1 has NaN or infinite"):
        D.ArrayDataset(x, np.zeros(5, np.int64))
    csv = tmp_path / "t.csv"
    csv.write_text("a,b,target\n1,2,0\n3,inf,1\n")
    with pytest.raises(D.DataError, match=r"t\.csv: line 3 has a NaN.*column 'b'"):
        DS.load_tabular_csv(csv)
    csv.write_text("a,b,target\n1,2,0\n3,,1\n")  # a missing value is NaN too
    with pytest.raises(D.DataError, match=r"t\.csv: line 3 has a NaN.*column 'b'"):
        DS.load_tabular_csv(csv)


def test_ragged_rows(tmp_path):
    csv = tmp_path / "r.csv"
    csv.write_text("a,b,target\n1,2,0\n3,4,5,1\n")
    with pytest.raises(D.DataError, match=r"r\.csv: line 3 has 4 fields, the header has 3"):
        DS.load_tabular_csv(csv)
    csv.write_text("a,b,target\n1,2,0\n3,1\n")
    with pytest.raises(D.DataError, match=r"line 3 has 2 fields"):
        DS.load_tabular_csv(csv)
    with pytest.raises(D.DataError, match=r"row 2 has shape \(2,\), row 0 has \(3,\)"):
        D.ArrayDataset([[1, 2, 3], [4, 5, 6], [7, 8]], [0, 1, 0])
    folder = _folder(tmp_path / "f", rows=["file,label,split", "images/0000.png,0,train,extra"])
    with pytest.raises(D.DataError, match="line 2 has 4 fields"):
        DS.ImageFolderDataset(folder)


def test_tabular_bad_labels(tmp_path):
    csv = tmp_path / "l.csv"
    csv.write_text("a,target\n1,0\n2,3\n")
    with pytest.raises(D.DataError, match=r"l\.csv: line 3: label 3 is out of range 0\.\.1"):
        DS.load_tabular_csv(csv, num_classes=2)
    csv.write_text("a,target\n1,0\n2,\n")
    with pytest.raises(D.DataError, match=r"line 3: label column 'target' must hold integers"):
        DS.load_tabular_csv(csv)
    csv.write_text("a,target\n1,0\nx,1\n")
    with pytest.raises(D.DataError, match=r"column 'a' is not numeric"):
        DS.load_tabular_csv(csv)


def test_empty_dataset(tmp_path):
    with pytest.raises(D.DataError, match="empty"):
        D.ArrayDataset(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    folder = _folder(tmp_path, rows=["file,label,split"])
    with pytest.raises(D.DataError, match=r"labels\.csv: the dataset is empty"):
        DS.ImageFolderDataset(folder)
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(D.DataError, match=r"e\.csv: the file is empty"):
        DS.load_tabular_csv(tmp_path / "e.csv")
    (tmp_path / "h.csv").write_text("a,target\n")
    with pytest.raises(D.DataError, match=r"h\.csv: the dataset is empty"):
        DS.load_tabular_csv(tmp_path / "h.csv")
    with pytest.raises(D.DataError, match="empty"):
        D.make_eval_loader([], 4, world_size=2, rank=0)
    with pytest.raises(D.DataError, match="empty"):
        D.make_train_loader([], 4, world_size=2, rank=0)
    with pytest.raises(D.DataError, match="empty"):
        D.make_eval_loader([], 4, world_size=1, rank=0)


def test_mismatched_lengths_and_bad_arguments():
    with pytest.raises(D.DataError, match="3 images but 2 labels"):
        D.ArrayDataset(np.zeros((3, 2), np.float32), [0, 1])
    ten = D.ArrayDataset(np.zeros((10, 2), np.float32), np.arange(10) % 2)
    with pytest.raises(D.DataError, match=r"rank 8 is not in 0\.\.7"):
        D.make_eval_loader(ten, 16, world_size=8, rank=8)
    with pytest.raises(D.DataError, match="global_batch must be >= 1"):
        D.make_eval_loader(ten, 0, world_size=1, rank=0)
    with pytest.raises(D.DataError, match="split must be one of"):
        DS.load_digits("valid")


def test_training_set_too_small_then_eval_pads(tmp_path):
    ds = DS.ImageFolderDataset(_folder(tmp_path))
    with pytest.raises(D.DataError, match=r"training set too small: 6 samples over 4 replica"):
        D.make_train_loader(ds, 16, world_size=4, rank=0)  # 4 per replica
    got = []
    for rank in range(4):
        (batch,) = list(D.make_eval_loader(ds, 16, world_size=4, rank=rank))
        x, y, index, mask = batch
        assert x.shape == (4, 1, 8, 8) and int(mask.sum()) == len(index[mask])
        got += index[mask].tolist()
    assert sorted(got) == list(range(6))


def test_file_broken_after_checking_fails_in_worker_with_file_name(tmp_path):
    """A file that goes bad after the up-front check still fails loudly, naming the file,
    through DataLoader worker processes (no hang, no silently shorter epoch)."""
    folder = _folder(tmp_path, n=8)
    ds = DS.ImageFolderDataset(folder)
    (folder / "images" / "0006.png").write_bytes(b"garbage")
    loader = D.make_eval_loader(ds, 2, world_size=1, rank=0, num_workers=2)
    loader.timeout = 60  # a stuck worker would fail the test, not hang it
    with pytest.raises(D.DataError, match=r"0006\.png: not a readable image"):
        for _ in loader:
            pass


def test_none_of_this_imports_torch_xla(repo):
    code = """
import sys, numpy as np
from tpu_helpers import data as D
from course import datasets as DS
for bad in (lambda: D.ArrayDataset(np.zeros((0, 2)), []),
            lambda: D.make_train_loader(D.ArrayDataset(np.zeros((3, 2)), [0, 1, 2]), 4,
                                        world_size=1, rank=0),
            lambda: DS.load_tabular_csv('missing.csv')):
    try:
        bad()
    except D.DataError:
        pass
    else:
        raise SystemExit('no error')
assert 'torch_xla' not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True, timeout=120)
