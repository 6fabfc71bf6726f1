"""tpu_helpers.sharded_checkpoint: checkpoints saved by several hosts at once (a pod's hosts).

Each host of a pod is one process; here each is a real process (its own XLA:CPU runtime under
SPMD with 2 virtual devices) in a real gloo process group (``file://`` rendezvous), which is
what ``torch.distributed.checkpoint`` coordinates through. What this exercises is the folder
protocol between hosts: who writes which file where, who renames the folder into place, and
that a new set of processes reads back every bit. Each process holds:

* ``common``: an XLA tensor sharded over its own devices, the same on every host (the planner
  keeps one copy: the coordinator's);
* ``rows``: the rows of one tensor split across hosts (host r holds rows 3r..3r+2), passed as
  torch_xla's ``_CpuShards``, the host-side form of a host's addressable shards that
  torch_xla's own ``CheckpointManager`` hands to ``dist_cp`` (XLA:CPU cannot make one XLA
  tensor span two processes; on a pod ``SPMDSavePlanner`` finds these shards itself);
* ``own`` (local storage only): a tensor whose values differ per host.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import REPO, forked_ranks

WORKER = r"""
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
import torch_xla, torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards
from tpu_helpers.sharded_checkpoint import (ShardedCheckpointError, load_sharded_checkpoint,
                                            save_sharded_checkpoint)
from tpu_helpers.spmd import device_mesh

action, storages, root, init = sys.argv[1:5]
rank, world = int(sys.argv[5]), int(sys.argv[6])
xr.use_spmd()
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
mesh, dev = device_mesh(("data",)), torch_xla.device()
ROWS = 3

def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

def sharded(t):
    x = t.to(dev)
    xs.mark_sharding(x, mesh, ("data", None))
    return x

common, rows, own = randn(1, 4, 6), randn(2, ROWS * world, 5), randn(10 + rank, 2, 3)
mine = slice(rank * ROWS, (rank + 1) * ROWS)


def case(storage):  # one storage mode, in the group's folders for it
    folder = Path(root) / (f"host{rank}" if storage == "local" else "shared") / "ck"
    out = {"rank": rank}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except Exception as exc:
            out[name] = [type(exc).__name__, str(exc)]

    if action == "save":
        shard = xs.XLAShard(rows[mine].clone(), [mine, slice(0, 5)], "CPU:0", 0)
        state = {"common": sharded(common), "rows": _CpuShards([shard], rows.shape)}
        if storage == "local":
            state["own"] = own
        kw = {"storage": "local"} if storage == "local" else {}  # "shared" is the default
        save_sharded_checkpoint(state, folder, **kw)
        save_sharded_checkpoint(state, folder, **kw)  # again, over the first one

        class Unpicklable:
            def __reduce__(self):
                raise RuntimeError("rank 1 cannot write this")
        bad = {**state, "extra": Unpicklable()} if rank == 1 else state
        attempt("failed_save", lambda: save_sharded_checkpoint(bad, folder, **kw))
        dist.barrier()
        out["listing"] = sorted(os.listdir(folder.parent))
        out["files"] = sorted(os.listdir(folder))
    else:
        back = {"common": sharded(torch.zeros(4, 6))}
        if storage == "local":
            back["own"] = torch.zeros(2, 3)
            attempt("load", lambda: load_sharded_checkpoint(back, folder))
            out["own_equal"] = torch.equal(back["own"], own)
            # a host's own folder holds its rows of `rows`, not the others': asking for all
            # of them must fail by name, on every host, never load a part silently
            attempt("all_rows", lambda: load_sharded_checkpoint(
                {"rows": torch.zeros(rows.shape)}, folder))
        else:
            back["rows"] = torch.zeros(rows.shape)
            attempt("load", lambda: load_sharded_checkpoint(back, folder))
            out["rows_equal"] = torch.equal(back["rows"], rows)
        out["common_equal"] = torch.equal(back["common"].cpu(), common)
        out["common_spec_kept"] = torch_xla._XLAC._get_xla_sharding_spec(back["common"]) != ""
    dist.barrier()
    return out


# both storage modes in the same processes (one torch_xla start per host, not two)
report = {storage: case(storage) for storage in storages.split(",")}
dist.destroy_process_group()
print("JSON" + json.dumps(report))
"""


def run_group(tmp_path, action: str, storages: str = "shared,local",
              world: int = 2) -> list[dict]:
    """Run ``world`` worker processes in one gloo group (forked from one process that imported
    the worker's modules once: conftest.forked_ranks); return each one's JSON report
    (storage mode -> what that case saw)."""
    init = tmp_path / f"init-{action}"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2",
           "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    outputs = forked_ranks(WORKER, [[action, storages, str(tmp_path / "ckpts"), str(init),
                                     str(r), str(world)] for r in range(world)],
                           tmp_path / f"{action}-rank-", env)
    return [json.loads(next(ln for ln in out.splitlines() if ln.startswith("JSON"))[4:])
            for out in outputs]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Two hosts save both ways (a shared folder, each host's own), then two new processes
    load both back."""
    tmp = tmp_path_factory.mktemp("hosts")
    return run_group(tmp, "save"), run_group(tmp, "load")


@pytest.fixture(scope="module")
def shared(groups):
    return tuple([report["shared"] for report in reports] for reports in groups)


@pytest.fixture(scope="module")
def local(groups):
    return tuple([report["local"] for report in reports] for reports in groups)


def test_shared_folder_holds_every_hosts_shards_and_the_metadata(shared):
    saved, _ = shared
    for report in saved:  # every host sees the same one folder, nothing else left beside it
        assert report["listing"] == ["ck"]
        assert report["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_shared_checkpoint_loads_back_bit_for_bit_in_new_processes(shared):
    _, loaded = shared
    for report in loaded:
        assert report["load"] == "ok"
        assert report["rows_equal"] and report["common_equal"] and report["common_spec_kept"]


def test_a_failed_save_on_one_host_raises_on_every_host_and_keeps_the_old_one(shared):
    saved, loaded = shared  # the loads above read the checkpoint kept after the failure
    for report in saved:
        kind, message = report["failed_save"]
        assert "rank 1 cannot write this" in message, (kind, message)


def test_local_folders_each_hold_a_complete_checkpoint_of_their_host(local):
    saved, _ = local
    for report in saved:
        assert report["listing"] == ["ck"]
        assert report["files"] == [".metadata", "__0_0.distcp"]
        assert "rank 1 cannot write this" in report["failed_save"][1]


def test_local_checkpoint_loads_each_hosts_own_values_back(local):
    _, loaded = local
    for report in loaded:
        assert report["load"] == "ok"
        assert report["own_equal"] and report["common_equal"] and report["common_spec_kept"]


def test_local_checkpoint_refuses_rows_another_host_holds(local):
    _, loaded = local
    for report in loaded:
        kind, message = report["all_rows"]
        assert kind == "ShardedCheckpointError", message
        assert "'rows'" in message and "ck" in message
