"""tpu_helpers.ordering (the pure ordering / de-duplication and the rank files: property
tests, numpy only) and tpu_helpers.predict (the world-size-1 XLA path in this process, bad
input caught before any compile).

Multi-process (gloo), SPMD (4 virtual devices) and ``torch_xla.launch`` runs are in
``tests/test_predict_multiprocess.py`` (fresh processes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import run_python
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from tpu_helpers.checkpoint import atomic_write
from tpu_helpers.data import make_eval_loader, replica_eval_indices
from tpu_helpers.ordering import (
    OrderedBuffer,
    PredictionError,
    exactly_once,
    merge_rank_files,
    rank_file_name,
    save_rank_file,
)
from tpu_helpers.predict import PredictOptions, predict

PRIMES = [2, 3, 5, 7, 11, 13, 61, 97, 127, 251, 509, 997]
sizes = st.one_of(st.integers(1, 1000), st.sampled_from([1, 2, 3, 4, 5, 6, 7, *PRIMES]))
worlds = st.integers(1, 8)
batches = st.integers(1, 64)
FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def reference(index: np.ndarray) -> np.ndarray:
    """What a correct model predicts for dataset index i: a row that identifies i."""
    i = index.astype(np.float64)
    return np.stack([i * 2 + 0.5, -i, i % 7], axis=-1)


def gathered_like_all_gather(n: int, batch: int, world: int) -> tuple[np.ndarray, ...]:
    """What ``xm.all_gather`` hands the host: per step, every replica's batch in rank
    order -> index/mask ``[steps, world * batch]``, values ``[steps, world * batch, 3]``.
    Padding rows get garbage values (they must never reach the result)."""
    shards = [np.asarray(replica_eval_indices(n, batch, world, r)).reshape(-1, batch)
              for r in range(world)]
    index = np.concatenate(shards, axis=1)
    mask = index >= 0
    values = np.where(mask[..., None], reference(index), 1e9)
    return index, mask, values


@FAST
@given(n=sizes, world=worlds, batch=batches)
@example(n=1, world=8, batch=64)
@example(n=5, world=8, batch=1)   # fewer samples than replicas
@example(n=997, world=7, batch=13)
def test_gathered_shards_come_back_once_in_order(n, world, batch):
    index, mask, values = gathered_like_all_gather(n, batch, world)
    assert index.shape[1] == world * batch  # every replica ran the same number of steps
    out = exactly_once(index, mask, values, n=n)
    np.testing.assert_array_equal(out.index, np.arange(n))
    np.testing.assert_array_equal(out.values, reference(np.arange(n)))
    assert out.duplicates == 0
    # mask=None means "index >= 0": the same result
    again = exactly_once(index, None, values, n=n)
    np.testing.assert_array_equal(again.values, out.values)


@FAST
@given(n=sizes, world=worlds, batch=batches, data=st.data())
def test_chunks_in_any_order_and_split_give_the_same_result(n, world, batch, data):
    index, mask, values = gathered_like_all_gather(n, batch, world)
    steps = index.shape[0]
    chunk = data.draw(st.integers(1, steps), label="chunk_steps")
    starts = list(range(0, steps, chunk))
    order = data.draw(st.permutations(starts), label="chunk order")
    buf = OrderedBuffer(n)
    for s in order:
        buf.add(index[s:s + chunk], mask[s:s + chunk],
                torch.from_numpy(values[s:s + chunk]))  # torch CPU tensors too
    out = buf.result()
    np.testing.assert_array_equal(out.index, np.arange(n))
    np.testing.assert_array_equal(out.values, reference(np.arange(n)))
    assert buf.padding_rows == index.size - n
    assert buf.duplicates == 0
    # host memory: the result plus the largest chunk handed in, nothing proportional more
    assert buf.chunk_bytes_max <= values[:chunk].nbytes


@FAST
@given(n=sizes, world=worlds, batch=batches, data=st.data())
def test_repeated_parts_are_dropped_and_counted(n, world, batch, data):
    """Parts of any split (what ``predict`` adds: one per step), some handed in twice."""
    index, mask, values = gathered_like_all_gather(n, batch, world)
    cut = sorted(data.draw(st.sets(st.integers(1, max(1, index.shape[0] - 1)), max_size=5)))
    bounds = [0, *[c for c in cut if c < index.shape[0]], index.shape[0]]
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    parts = [(torch.from_numpy(index[a:b]), torch.from_numpy(mask[a:b]),
              torch.from_numpy(values[a:b]).float()) for a, b in spans]
    half = len(parts) // 2
    buf = OrderedBuffer(n)
    for part in parts[:half] + parts[:half] + parts[half:]:  # a repeated chunk: dropped
        buf.add(*part)
    out = buf.result()
    np.testing.assert_array_equal(out.values, reference(np.arange(n)).astype(np.float32))
    assert buf.duplicates == int(sum((p[1]).sum() for p in parts[:half]))
    assert buf.padding_rows == index.size - n + int(sum((~p[1]).sum() for p in parts[:half]))


@FAST
@given(n=sizes, world=worlds, shuffle=st.booleans())
def test_distributed_sampler_padding_duplicates_are_dropped(n, world, shuffle):
    """DistributedSampler pads by REPEATING samples and deals them out strided (or
    shuffled): concatenating the shards gives duplicates in the wrong order."""
    shards = [np.array(list(DistributedSampler(range(n), num_replicas=world, rank=r,
                                               shuffle=shuffle, seed=3)))
              for r in range(world)]
    naive = np.concatenate(shards)
    expected_dups = world * math.ceil(n / world) - n
    assert len(naive) - n == expected_dups
    if 1 < world < n and not shuffle:  # strided: the concatenation is out of order
        assert not np.array_equal(naive[:n], np.arange(n))
    out = exactly_once(naive, np.ones(naive.shape, bool), reference(naive), n=n)
    np.testing.assert_array_equal(out.index, np.arange(n))
    np.testing.assert_array_equal(out.values, reference(np.arange(n)))
    assert out.duplicates == expected_dups


def test_torch_cpu_tensors_in_numpy_out():
    index = torch.tensor([[2, 0], [1, -1]])
    mask = index >= 0
    values = torch.arange(8.0).reshape(2, 2, 2)
    out = exactly_once(index, mask, values, n=3)
    assert isinstance(out.values, np.ndarray) and isinstance(out.index, np.ndarray)
    assert out.values.tolist() == [[2.0, 3.0], [4.0, 5.0], [0.0, 1.0]]
    again = exactly_once(index.numpy(), mask.numpy(), values.numpy(), n=3)
    np.testing.assert_array_equal(again.values, out.values)


def test_ordering_imports_no_torch():
    """ordering.py is numpy + stdlib: importing it pulls in neither torch nor torch_xla."""
    proc = run_python("import sys\nimport tpu_helpers.ordering\n"
                      "print(sorted(m for m in sys.modules if m.startswith('torch')))", fresh=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_host_objects_such_as_strings():
    index = np.array([3, 1, -1, 0, 2, 1])
    names = np.array(["d", "b", "pad", "a", "c", "b-again"], dtype=object)
    out = exactly_once(index, None, names, n=4)
    assert out.values.tolist() == ["a", "b", "c", "d"]
    assert out.duplicates == 1  # the first in gather order wins


def test_n_none_orders_what_is_there():
    out = exactly_once(np.array([9, 4, -1]), None, np.array([90, 40, 0]))
    assert out.index.tolist() == [4, 9] and out.values.tolist() == [40, 90]


def test_lost_replica_is_named():
    index, mask, values = gathered_like_all_gather(37, 4, 3)
    lost = index[:, 4:8]  # replica 1's rows
    keep = np.ones(index.shape, bool)
    keep[:, 4:8] = False
    with pytest.raises(PredictionError, match=r"missing .*first: \[1, 4, 7"):
        exactly_once(index, mask & keep, values, n=37)
    assert (lost >= 0).any()


def test_bad_rows_are_named():
    with pytest.raises(PredictionError, match=r"row \(1,\) is marked real .* index -1"):
        exactly_once(np.array([0, -1]), np.array([True, True]), np.zeros(2), n=1)
    with pytest.raises(PredictionError, match=r"row \(1,\) has dataset index 5, out of range"):
        exactly_once(np.array([0, 5]), None, np.zeros(2), n=2)
    with pytest.raises(PredictionError, match="leading dimensions"):
        exactly_once(np.array([0, 1]), None, np.zeros((3, 2)), n=2)
    with pytest.raises(PredictionError, match="mask has shape"):
        exactly_once(np.array([0, 1]), np.array([True]), np.zeros(2))
    with pytest.raises(TypeError, match="integers"):
        exactly_once(np.array([0.0, 1.0]), None, np.zeros(2))
    buf = OrderedBuffer(3)
    buf.add(np.array([0, 1]), None, np.zeros((2, 4), np.float32))
    with pytest.raises(PredictionError, match="every chunk must match"):
        buf.add(np.array([2]), None, np.zeros((1, 5), np.float32))
    with pytest.raises(PredictionError, match=r"1 of 3 .* missing .*\[2\]"):
        buf.result()


def _write_rank_files(folder, n: int, world: int, batch: int) -> None:
    for r in range(world):
        idx = np.asarray(replica_eval_indices(n, batch, world, r))
        atomic_write(folder / rank_file_name(r, world),
                     lambda f, idx=idx, r=r: save_rank_file(f, idx, idx >= 0, reference(idx),
                                                            rank=r, world_size=world, n=n))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=sizes, world=worlds, batch=batches)
def test_rank_files_merge_exactly_once(tmp_path_factory, n, world, batch):
    folder = tmp_path_factory.mktemp("ranks")
    _write_rank_files(folder, n, world, batch)
    assert sorted(p.name for p in folder.iterdir()) == [rank_file_name(r, world)
                                                         for r in range(world)]
    out = merge_rank_files(folder, world, n)
    np.testing.assert_array_equal(out.index, np.arange(n))
    np.testing.assert_array_equal(out.values, reference(np.arange(n)))
    assert out.duplicates == 0


def test_rank_files_are_checked_and_named(tmp_path):
    n, world = 23, 3
    _write_rank_files(tmp_path, n, world, 4)
    assert rank_file_name(2, 3) == "rank00002-of-00003.npz"
    with pytest.raises(PredictionError, match=r"rank00000-of-00003\.npz: written for .*'n': 23"
                                              r".* merging .*'n': 24"):
        merge_rank_files(tmp_path, world, 24)
    path = tmp_path / rank_file_name(1, world)
    other = tmp_path / rank_file_name(2, world)
    path.write_bytes(other.read_bytes())  # rank 2's file under rank 1's name
    with pytest.raises(PredictionError, match=r"rank00001-of-00003\.npz: written for "
                                              r"\{'rank': 2"):
        merge_rank_files(tmp_path, world, n)
    path.write_bytes(other.read_bytes()[:100])  # truncated
    with pytest.raises(PredictionError, match=r"rank00001-of-00003\.npz: corrupt"):
        merge_rank_files(tmp_path, world, n)
    path.unlink()
    with pytest.raises(PredictionError, match=r"rank00001-of-00003\.npz: missing; rank 1"):
        merge_rank_files(tmp_path, world, n)
    idx = np.arange(2)  # a rank that lost rows: the merge names what is missing
    atomic_write(path, lambda f: save_rank_file(f, idx, None, reference(idx), rank=1,
                                                world_size=world, n=n))
    with pytest.raises(PredictionError, match=r"missing from the gathered rows"):
        merge_rank_files(tmp_path, world, n)


class Payload:
    """Unpickling this calls ``os.makedirs(marker)``: harmless, and easy to see."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.makedirs, (self.marker,))


def test_rank_files_with_pickled_objects_are_refused(tmp_path):
    import io
    import pickle

    marker = tmp_path / "CODE-RAN"
    values = np.empty(2, dtype=object)
    values[:] = [Payload(marker), Payload(marker)]
    buf = io.BytesIO()
    np.savez(buf, index=np.arange(2), mask=np.ones(2, bool), values=values, rank=0,
             world_size=1, n=2)
    path = tmp_path / rank_file_name(0, 1)
    path.write_bytes(buf.getvalue())
    with pytest.raises(PredictionError, match=r"rank00000-of-00001\.npz: refused: not a plain"):
        merge_rank_files(tmp_path, 1, 2)
    path.write_bytes(pickle.dumps(Payload(marker)))  # not even an npz
    with pytest.raises(PredictionError, match=r"rank00000-of-00001\.npz: "):
        merge_rank_files(tmp_path, 1, 2)
    assert not marker.exists()
    pickle.loads(pickle.dumps(Payload(marker)))  # the payload is real: plain pickle runs it
    assert marker.is_dir()
    with pytest.raises(PredictionError, match="numeric arrays only"):
        save_rank_file(io.BytesIO(), np.arange(2), None, values, rank=0, world_size=1, n=2)


# --------------------------------------------------------------------------- XLA, world 1


@pytest.fixture(scope="module")
def digits():
    from course.datasets import load_digits
    from tpu_helpers.data import ArrayDataset

    x, y = load_digits("test")
    return ArrayDataset(x, y), x


@pytest.fixture(scope="module")
def xla_model():
    import torch_xla

    from course.models import DigitsCNN

    torch.manual_seed(0)
    cpu = DigitsCNN().eval()
    dev = torch_xla.device()
    model = DigitsCNN().eval()
    model.load_state_dict(cpu.state_dict())
    return cpu, model.to(dev)


def test_world_size_1_equals_plain_forward_with_one_graph(digits, xla_model):
    import torch_xla.debug.metrics as met

    ds, x = digits
    cpu, model = xla_model
    expected = cpu(torch.from_numpy(x)).detach().numpy()
    met.clear_all()
    compiles = 0
    for n in (len(ds), len(ds) - 1, 31, 17, 1):  # every remainder modulo batch 16
        loader = make_eval_loader(torch.utils.data.Subset(ds, range(n)), 16)
        pred = predict(model, loader)
        np.testing.assert_array_equal(pred.index, np.arange(n))
        np.testing.assert_allclose(pred.values, expected[:n], rtol=1e-5, atol=1e-5)
        assert pred.transfers_from_device == 1  # one transfer to the host for the run
        assert pred.padding_rows == math.ceil(n / 16) * 16 - n
        compiles += pred.compiles
    assert compiles == 1, "one predict graph whatever len(dataset) % batch is"
    assert model.training is False


def test_bounded_chunks_same_result(digits, xla_model):
    ds, _ = digits
    _, model = xla_model
    whole = predict(model, make_eval_loader(ds, 16))
    chunked = predict(model, make_eval_loader(ds, 16), options=PredictOptions(chunk_bytes=1))
    np.testing.assert_array_equal(whole.values, chunked.values)
    assert chunked.transfers_from_device == math.ceil(len(ds) / 16)  # one step per chunk


def test_rank_file_path_world_1(digits, xla_model, tmp_path):
    """gather=False: this rank's own rows, written as a rank file, merged by the master."""
    ds, _ = digits
    _, model = xla_model
    model.train()  # predict switches to eval and restores the mode
    whole = predict(model, make_eval_loader(ds, 16))
    own = predict(model, make_eval_loader(ds, 16),
                  options=PredictOptions(gather=False, chunk_bytes=4096))
    assert model.training is True
    model.eval()
    atomic_write(tmp_path / rank_file_name(0, 1),
                 lambda f: save_rank_file(f, own.index, None, own.values, rank=0,
                                          world_size=1, n=len(ds)))
    merged = merge_rank_files(tmp_path, 1, len(ds))
    np.testing.assert_array_equal(whole.values, merged.values)
    assert own.transfers_from_device > 1  # really chunked


def test_bfloat16_outputs_come_back_as_float32(digits):
    import torch_xla

    ds, x = digits
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)).to(torch.bfloat16)
    inputs = torch.from_numpy(x).to(torch.bfloat16)
    expected = cpu(inputs).float().detach().numpy()
    model = cpu.to(torch_xla.device())
    loader = make_eval_loader(torch.utils.data.TensorDataset(inputs, torch.zeros(len(x))), 16)
    pred = predict(model, loader)
    assert pred.values.dtype == np.float32 and pred.values.shape == (len(ds), 10)
    np.testing.assert_allclose(pred.values, expected, rtol=2e-2, atol=2e-2)


class _Dict(torch.nn.Module):
    def forward(self, x):
        return {"logits": x.flatten(1)}


class _DropsRows(torch.nn.Module):
    def forward(self, x):
        return x.flatten(1)[:-1]


class _ShapeChangesAtStep1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.flatten(1)[:, : 8 if self.calls == 1 else 9] * 2


@pytest.mark.parametrize("model, match", [
    (_Dict(), "returned a dict at step 0"),
    (_DropsRows(), r"shape \(15, 64\) at step 0 for a batch of 16 rows"),
])
def test_bad_model_output_fails_before_any_compile(digits, model, match):
    import torch_xla.core.xla_model as xm

    from tpu_helpers.metrics import snapshot

    xm.wait_device_ops()
    before = snapshot()
    with pytest.raises(PredictionError, match=match):
        predict(model, make_eval_loader(digits[0], 16))
    xm.wait_device_ops()
    assert (snapshot() - before).compiles == 0


def test_output_shape_change_fails_before_its_graph_compiles(digits):
    import torch_xla.core.xla_model as xm

    from tpu_helpers.metrics import snapshot

    xm.wait_device_ops()
    before = snapshot()
    with pytest.raises(PredictionError, match=r"changed from \[16, 8\].* at step 1 "
                                              r"\(dataset indices \[16, 17, 18, 19\]"):
        predict(_ShapeChangesAtStep1(), make_eval_loader(digits[0], 16))
    xm.wait_device_ops()
    assert (snapshot() - before).compiles == 1  # step 0's graph; the bad one never compiles


def test_batches_without_indices_or_no_batches(digits):
    ds, x = digits

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from x

    with pytest.raises(PredictionError,
                       match=r"batch 0 is a torch.float32 tensor of shape \(16, 1, 8, 8\) with"):
        predict(_Dict(), torch.utils.data.DataLoader(Stream(), batch_size=16), n=len(x))
    plain = torch.utils.data.DataLoader(ds, batch_size=16)  # (x, y): no index, no mask
    with pytest.raises(PredictionError, match="batch 0 .* without dataset indices"):
        predict(_Dict(), plain)
    with pytest.raises(PredictionError, match="no batches"):
        predict(_Dict(), [], n=3)
    with pytest.raises(PredictionError, match="pass n"):
        predict(_Dict(), list(make_eval_loader(ds, 16)))


def test_partial_last_batch_is_refused(digits):
    """A user loader with a short last batch: refused before that batch's graph."""
    ds, _ = digits
    batches = list(make_eval_loader(ds, 16, world_size=1, rank=0))
    short = [*batches[:-1], tuple(t[:5] for t in batches[-1])]
    with pytest.raises(PredictionError, match=r"batch 22 has 5 rows .* batch 0 had 16"):
        predict(torch.nn.Flatten(), short, n=len(ds))


def test_device_tensors_are_refused_by_the_pure_function():
    import torch_xla

    t = torch.zeros(2, dtype=torch.int64, device=torch_xla.device())
    with pytest.raises(TypeError, match="move the gathered tensors to the host first"):
        exactly_once(t, None, np.zeros(2))


def _notebook_code(name: str, *defines: str) -> list[str]:
    """The code cells of ``notebooks/<name>`` that define any of ``defines``, in order."""
    import json

    from conftest import REPO

    cells = json.loads((REPO / "notebooks" / name).read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return [s for s in sources if any(f"\ndef {d}(" in "\n" + s for d in defines)]


def test_notebook_04_predict_by_hand_equals_predict(digits, xla_model):
    """Notebook 04 runs only the gather loop its cells write (``predict_by_hand``, with the
    ``#@save`` ``pack_ids``/``gather_step``); here it meets ``predict`` on the same loaders:
    the same rows, in order, with the same logits, for every remainder the notebook uses."""
    cells = _notebook_code("04_prediction_gathering.ipynb", "gather_step", "predict_by_hand")
    assert len(cells) == 2, "notebook 04: one #@save gather cell, one predict_by_hand cell"
    namespace = {"torch": torch, "exactly_once": exactly_once}
    for source in cells:
        exec(compile(source, "notebook-04", "exec"), namespace)
    ds, _ = digits
    _, model = xla_model
    for n in (len(ds), len(ds) - 1, len(ds) - 3):  # 360, 359, 357: the notebook's SIZES
        loader = make_eval_loader(torch.utils.data.Subset(ds, range(n)), 32)
        mine = namespace["predict_by_hand"](model, loader, n)
        theirs = predict(model, loader)
        np.testing.assert_array_equal(mine.index, np.arange(n))
        np.testing.assert_array_equal(mine.index, theirs.index)
        np.testing.assert_array_equal(mine.values, theirs.values)


def test_tensors_to_cpu_is_one_transfer_for_many_tensors():
    """The toolkit's named wrapper of the private many-tensor copy: one transfer for all the
    XLA tensors, in order, CPU tensors passed through untouched."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from tpu_helpers.predict import tensors_to_cpu

    dev = torch_xla.device()
    xla = [torch.arange(k, dtype=torch.float32).to(dev) * 2 for k in (3, 5, 7)]
    host = torch.ones(2)
    torch_xla.sync()
    before = (met.metric_data("TransferFromDeviceTime") or [0])[0]
    out = tensors_to_cpu([xla[0], host, xla[1], xla[2]])
    assert (met.metric_data("TransferFromDeviceTime") or [0])[0] - before == 1
    assert out[1] is host and all(t.device.type == "cpu" for t in out)
    for got, k in zip([out[0], out[2], out[3]], (3, 5, 7), strict=True):
        assert torch.equal(got, torch.arange(k, dtype=torch.float32) * 2)
