"""tpu_helpers.predict and ordering's rank files in fresh processes: real multi-process
gathering (torch.distributed with gloo, 3 processes; labelled and unlabelled items), SPMD on 4
and 8 virtual devices, and world size 1 under ``torch_xla.launch``.

XLA:CPU cannot run cross-process XLA collectives (pytorch/xla issue 9089), so the
multi-process test joins real processes with gloo for the collective
(``TorchDistributedReplicas``); the loop, padding, packing, ordering and de-duplication
code is the same as under ``torch_xla.launch`` on a TPU (only ``xm.all_gather`` differs).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import gloo_ranks, run_python

CASES = [(360, 16), (37, 4), (2, 8), (1, 1)]  # (n, batch): n prime, n < world, n = 1


def expected_logits(n: int) -> np.ndarray:
    from course.datasets import load_digits
    from course.models import DigitsCNN

    x, _ = load_digits("test")
    torch.manual_seed(0)
    model = DigitsCNN().eval()
    with torch.no_grad():
        return model(torch.from_numpy(x[:n])).numpy()


WORKER = """
import json, os, sys
import numpy as np, pandas as pd, torch, torch.distributed as dist
import torch_xla
from tpu_helpers.checkpoint import atomic_write
from tpu_helpers.data import ArrayDataset, PaddedEvalDataset, make_eval_loader, replica_eval_indices
from tpu_helpers.ordering import exactly_once, merge_rank_files, rank_file_name, save_rank_file
from course.datasets import load_digits
from course.models import DigitsCNN
from tpu_helpers.predict import PredictOptions, TorchDistributedReplicas, predict

rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "init"),
                        rank=rank, world_size=world)
x, y = load_digits("test")
ds = ArrayDataset(x, y)
torch.manual_seed(0)
model = DigitsCNN().eval().to(torch_xla.device())
backend = TorchDistributedReplicas()
opts = PredictOptions(backend=backend)
report = {"rank": rank, "world": backend.world_size}
for n, batch in json.loads(sys.argv[4]):
    loader = make_eval_loader(torch.utils.data.Subset(ds, range(n)), batch * world,
                              world_size=world, rank=rank)  # the global batch
    pred = predict(model, loader, options=opts)
    assert (pred is None) == (rank != 0), (rank, pred)
    if pred is not None:  # the master writes the CSV (atomically)
        frame = pd.DataFrame(pred.values, index=pd.Index(pred.index, name="index"))
        atomic_write(f"{out}/pred-{n}.csv", frame.to_csv)
        report[f"compiles-{n}"] = pred.compiles
        np.save(f"{out}/gathered-{n}.npy", pred.values)
        report[f"dups-{n}"] = pred.duplicates
        report[f"padding-{n}"] = pred.padding_rows
    if n == 37:  # every rank asks for the result
        everyone = predict(model, loader, options=PredictOptions(backend=backend, all_ranks=True))
        np.save(f"{out}/all-{n}-rank{rank}.npy", everyone.values)
# unlabelled items, as a test file's: each item the image alone (a tensor), no label
unlabelled = list(torch.from_numpy(x[:37]))
pred = predict(model, make_eval_loader(unlabelled, 4 * world, world_size=world, rank=rank),
               options=opts)
if pred is not None:
    np.save(f"{out}/unlabelled.npy", pred.values)
    report["unlabelled_index"] = pred.index.tolist()
# outputs too big to gather: every rank writes its own rows to a rank file, the master merges
loader = make_eval_loader(ds, 16 * world, world_size=world, rank=rank)
own = predict(model, loader, options=PredictOptions(backend=backend, gather=False,
                                                    chunk_bytes=2048))
report["own_rows"] = len(own.index)
atomic_write(f"{out}/ranks/{rank_file_name(rank, world)}",
             lambda f: save_rank_file(f, own.index, None, own.values, rank=rank,
                                      world_size=world, n=len(ds)))
dist.barrier()  # every rank file is written
if rank == 0:
    np.save(f"{out}/sharded.npy", merge_rank_files(f"{out}/ranks", world, len(ds)).values)
# fewer samples (2) than ranks (3), rank files: make_eval_loader's batches (rank 2: padding
# only), and shards of one's own without padding (rank r: indices r, r + 3, ...; rank 2: none)
small = torch.utils.data.Subset(ds, range(2))
own_shard = torch.utils.data.DataLoader(PaddedEvalDataset(small), batch_size=4,
                                        sampler=list(range(rank, 2, world)))
for name, loader in (("padded", make_eval_loader(small, 4 * world, world_size=world,
                                                  rank=rank)),
                     ("own", own_shard)):
    mine = predict(model, loader, options=PredictOptions(backend=backend, gather=False))
    atomic_write(f"{out}/few-{name}/{rank_file_name(rank, world)}",
                 lambda f: save_rank_file(f, mine.index, None, mine.values, rank=rank,
                                          world_size=world, n=2))
    report[f"few-{name}-rows"] = len(mine.index)
    dist.barrier()
    if rank == 0:
        np.save(f"{out}/few-{name}.npy", merge_rank_files(f"{out}/few-{name}", world, 2).values)
# small host objects (file names): a host gather, then the same exactly_once
idx = np.asarray(replica_eval_indices(len(ds), 16, world, rank))
names = np.array([f"digit-{i:04d}.png" if i >= 0 else "" for i in idx], dtype=object)
parts = [None] * world
dist.all_gather_object(parts, (idx, names))
rows = exactly_once(np.concatenate([p[0] for p in parts]), None,
                    np.concatenate([p[1] for p in parts]), n=len(ds))
report["names_ok"] = rows.values.tolist() == [f"digit-{i:04d}.png" for i in range(len(ds))]
json.dump(report, open(f"{out}/report-{rank}.json", "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_three_real_processes_gather_exactly_once_in_order(tmp_path):
    world = 3
    reports = gloo_ranks(WORKER, world, tmp_path, json.dumps(CASES))
    assert [r["world"] for r in reports] == [world] * world
    full = expected_logits(360)
    for n, batch in CASES:
        gathered = np.load(tmp_path / f"gathered-{n}.npy")
        assert gathered.shape == (n, 10)
        np.testing.assert_allclose(gathered, full[:n], rtol=1e-5, atol=1e-5)
        assert reports[0][f"dups-{n}"] == 0
        # one graph per batch shape, as on the other paths (each case has a new batch)
        assert reports[0][f"compiles-{n}"] == 1, (n, reports[0][f"compiles-{n}"])
        steps = -(-n // (batch * world))
        assert reports[0][f"padding-{n}"] == steps * batch * world - n
        frame = pd.read_csv(tmp_path / f"pred-{n}.csv", index_col="index")
        assert frame.index.tolist() == list(range(n))
        np.testing.assert_allclose(frame.to_numpy(), gathered, rtol=1e-6, atol=1e-6)
    for r in range(world):  # all_ranks=True: the same result everywhere
        np.testing.assert_array_equal(np.load(tmp_path / f"all-37-rank{r}.npy"),
                                      np.load(tmp_path / "gathered-37.npy"))
    np.testing.assert_array_equal(np.load(tmp_path / "sharded.npy"),
                                  np.load(tmp_path / "gathered-360.npy"))
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == [
        f"rank{r:05d}-of-00003.npz" for r in range(world)]
    assert sum(r["own_rows"] for r in reports) == 360  # no rank held more than its own
    assert all(r["names_ok"] for r in reports)
    assert reports[0]["unlabelled_index"] == list(range(37))  # unlabelled: once, in order
    np.testing.assert_allclose(np.load(tmp_path / "unlabelled.npy"), full[:37],
                               rtol=1e-5, atol=1e-5)
    for name in ("padded", "own"):  # 2 samples on 3 ranks: rank 2 has no rows, its file none
        assert [r[f"few-{name}-rows"] for r in reports] == [1, 1, 0]
        np.testing.assert_allclose(np.load(tmp_path / f"few-{name}.npy"), full[:2],
                                   rtol=1e-5, atol=1e-5)


SPMD = """
import json
import numpy as np, torch
import torch_xla, torch_xla.runtime as xr
xr.use_spmd()
from tpu_helpers.data import ArrayDataset, make_eval_loader
from course.datasets import load_digits
from course.models import DigitsCNN
from tpu_helpers.predict import PredictOptions, SpmdMesh, predict
from tpu_helpers.spmd import device_mesh

x, y = load_digits("test")
ds = ArrayDataset(x, y)
torch.manual_seed(0)
model = DigitsCNN().eval().to(torch_xla.device())
devices = xr.global_runtime_device_count()

def run(n, batch, options=None):  # one global batch per step: batch x devices rows
    loader = make_eval_loader(torch.utils.data.Subset(ds, range(n)), batch * devices,
                              world_size=1, rank=0)
    return predict(model, loader, options=options)

report = {"devices": devices, "runs": []}
for n, batch in json.loads(CASES):
    pred = run(n, batch)
    np.save(f"OUT/spmd-{n}.npy", pred.values)
    report["runs"].append([n, pred.compiles, pred.transfers_from_device, pred.padding_rows])
# same batch, other remainders modulo (16 x 4): no new graph
report["recompiles"] = sum(run(n, 16).compiles for n in (359, 333, 65))
# a 2 x 2 mesh: rows split over 'data' (2), copies over 'model' are skipped, not duplicated
mesh = device_mesh(("data", "model"), (2, 2))
loader = make_eval_loader(ds, 16 * 2, world_size=1, rank=0)
pred = predict(model, loader, options=PredictOptions(backend=SpmdMesh(mesh)))
np.save("OUT/spmd-2x2.npy", pred.values)
report["dups_2x2"] = pred.duplicates
print(json.dumps(report))
"""


@pytest.mark.slow
def test_spmd_on_4_virtual_devices_same_result(tmp_path):
    code = SPMD.replace("OUT", str(tmp_path)).replace("CASES", repr(json.dumps(CASES)))
    proc = run_python(code, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    full = expected_logits(360)
    for (n, batch), (n2, _compiles, transfers, padding) in zip(CASES, report["runs"],
                                                             strict=True):
        assert n == n2
        np.testing.assert_allclose(np.load(tmp_path / f"spmd-{n}.npy"), full[:n],
                                   rtol=1e-5, atol=1e-5)
        assert transfers == 1  # every shard of the run in one transfer
        steps = -(-n // (batch * 4))
        assert padding == steps * batch * 4 - n
    # one compiled step graph per batch shape, whatever n % (batch x 4) is
    by_batch: dict[int, int] = {}
    for (_, batch), run in zip(CASES, report["runs"], strict=True):
        by_batch[batch] = by_batch.get(batch, 0) + run[1]
    assert by_batch == {16: 1, 4: 1, 8: 1, 1: 1}
    assert report["recompiles"] == 0
    np.testing.assert_allclose(np.load(tmp_path / "spmd-2x2.npy"), full, rtol=1e-5, atol=1e-5)
    assert report["dups_2x2"] == 0


LAUNCH = """
import json
import numpy as np, pandas as pd, torch
import torch_xla
import tpu_helpers.predict  # importing must not touch the device (launch would refuse)
from tpu_helpers.checkpoint import atomic_write
from tpu_helpers.data import ArrayDataset, make_eval_loader
from course.datasets import load_digits
from course.models import DigitsCNN

def run(index):
    import torch_xla.runtime as xr
    from tpu_helpers.predict import predict
    x, y = load_digits("test")
    ds = ArrayDataset(x, y)
    torch.manual_seed(0)
    model = DigitsCNN().eval().to(torch_xla.device())
    compiles = 0
    for n in (360, 359, 17, 1):
        pred = predict(model, make_eval_loader(torch.utils.data.Subset(ds, range(n)), 16))
        if xr.global_ordinal() == 0:
            frame = pd.DataFrame(pred.values, index=pd.Index(pred.index, name="index"))
            atomic_write(f"OUT/launch-{n}.csv", frame.to_csv)
        compiles += pred.compiles
    json.dump({"world": xr.world_size(), "rank": xr.global_ordinal(), "compiles": compiles},
              open("OUT/launch.json", "w"))

if __name__ == "__main__":
    torch_xla.launch(run, start_method="fork")
"""


@pytest.mark.slow
def test_world_size_1_under_launch(tmp_path):
    run_python(LAUNCH.replace("OUT", str(tmp_path)),
               env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})
    info = json.loads((tmp_path / "launch.json").read_text())
    assert info == {"world": 1, "rank": 0, "compiles": 1}
    full = expected_logits(360)
    for n in (360, 359, 17, 1):
        frame = pd.read_csv(tmp_path / f"launch-{n}.csv", index_col="index")
        assert frame.index.tolist() == list(range(n))
        np.testing.assert_allclose(frame.to_numpy(), full[:n], rtol=1e-5, atol=1e-5)


SPMD_CHUNKS = """
import json
import numpy as np, torch
import torch_xla, torch_xla.runtime as xr
xr.use_spmd()
from tpu_helpers.data import ArrayDataset, make_eval_loader
from course.datasets import load_digits
from course.models import DigitsCNN
from tpu_helpers.predict import DEFAULT_CHUNK_BYTES, PredictOptions, predict

torch.manual_seed(0)
devices = xr.global_runtime_device_count()
x, y = load_digits("test")
digits = DigitsCNN().eval().to(torch_xla.device())

def run(model, ds, batch, **options):
    loader = make_eval_loader(ds, batch * devices, world_size=1, rank=0)
    return predict(model, loader, options=PredictOptions(**options))

whole = run(digits, ArrayDataset(x, y), 8).values  # one chunk
# tiny chunks: a flush after every step, while the next step is still executing
tiny = [run(digits, ArrayDataset(x, y), 8, chunk_bytes=1024) for _ in range(REPEATS)]
# an 80 MiB output: more than one chunk of the 64 MiB default
n, width = 20480, 1024
inputs = torch.randn(n, 16)
wide = torch.nn.Linear(16, width)
expected = wide(inputs).detach().numpy()
wide = wide.to(torch_xla.device())
big = torch.utils.data.TensorDataset(inputs, torch.zeros(n, dtype=torch.long))
default = [run(wide, big, 256) for _ in range(REPEATS)]
print(json.dumps({
    "devices": devices,
    "tiny_equal": [bool(np.array_equal(p.values, whole)) for p in tiny],
    "tiny_transfers": tiny[0].transfers_from_device,
    "big_mib": default[0].values.nbytes / 2**20,
    "default_chunk_mib": DEFAULT_CHUNK_BYTES / 2**20,
    "big_error": max(float(np.abs(p.values - expected).max()) for p in default),
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 8])
def test_spmd_multi_chunk_gather_waits_for_the_running_step(devices):
    """Flushing a chunk while the next step still runs crashed ("async operation is in
    flight", or a process abort) on every tiny-chunk run and on about 3 of 7 default
    runs of an 80 MiB output. Repeated, on 4 and 8 virtual devices."""
    code = SPMD_CHUNKS.replace("REPEATS", "6")
    proc = run_python(code, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == devices
    assert report["tiny_equal"] == [True] * 6
    assert report["tiny_transfers"] > 1  # really more than one chunk
    assert report["big_mib"] > report["default_chunk_mib"]
    assert report["big_error"] < 1e-4
