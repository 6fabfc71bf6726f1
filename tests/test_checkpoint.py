"""Checkpoints: atomic writes, safe loading, a folder that finds the newest good one, RNG
state, every-rank saving with one writer, and a SIGKILL in the middle of a save."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch
from conftest import kill_mid_write, run_python

from tpu_helpers.checkpoint import (
    TEMP_MARKER,
    CheckpointDir,
    CheckpointError,
    capture_training_state,
    load_checkpoint,
    restore_rng_state,
    restore_training_state,
    rng_state,
    save_checkpoint,
    write_atomically,
)


class NotATensor:
    """Something weights_only loading must refuse (unpickling it could run code)."""

    def __init__(self) -> None:
        self.payload = "x"


def test_write_atomically_round_trips_and_leaves_no_temp_file(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7, "names": ["a", "b"],
             "nested": {"t": (1, 2.5, None)}}
    path = write_atomically(tmp_path / "sub" / "c.pt", state)
    assert path == tmp_path / "sub" / "c.pt"
    back = load_checkpoint(path)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7
    assert back["names"] == ["a", "b"] and back["nested"]["t"] == (1, 2.5, None)
    assert [p.name for p in path.parent.iterdir()] == ["c.pt"]


def test_write_atomically_keeps_the_old_file_when_serialising_fails(tmp_path):
    path = write_atomically(tmp_path / "c.pt", {"v": torch.ones(2)})

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    with pytest.raises(TypeError, match="cannot pickle"):
        write_atomically(path, {"v": torch.zeros(2), "bad": Unpicklable()})
    assert torch.equal(load_checkpoint(path)["v"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # temp file removed


def test_load_refuses_pickled_objects_and_names_the_file(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"obj": NotATensor()}, path)
    with pytest.raises(CheckpointError,
                       match=r"evil\.pt: refused: not a plain checkpoint: it asks to build a "
                             r"\S*NotATensor object"):
        load_checkpoint(path)


def test_load_reports_truncated_and_missing_files_by_name(tmp_path):
    good = write_atomically(tmp_path / "good.pt", {"w": torch.randn(1000)})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"cut\.pt: corrupt or truncated"):
        load_checkpoint(cut)
    with pytest.raises(CheckpointError, match=r"nothere\.pt: no such checkpoint"):
        load_checkpoint(tmp_path / "nothere.pt")
    write_atomically(tmp_path / "list.pt", [1, 2])
    with pytest.raises(CheckpointError, match="expected a dict"):
        load_checkpoint(tmp_path / "list.pt")


def test_checkpoint_dir_keeps_newest_and_skips_damaged_and_temp_files(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=2)
    for step in (3, 6, 9):
        ckpts.save({"step": step}, step=step, is_writer=True, barrier=lambda: None)
    assert ckpts.steps() == [6, 9]  # step 3 pruned
    stale = tmp_path / f"step-00000012.pt{TEMP_MARKER}999999"  # a killed writer's leftover
    stale.write_bytes(b"partial")
    assert ckpts.steps() == [6, 9]
    ckpts.path_for(9).write_bytes(b"damaged on disk")
    with pytest.warns(UserWarning, match=r"step-00000009\.pt: corrupt"):
        state, path = ckpts.load_latest()
    assert state == {"step": 6} and path == ckpts.path_for(6)
    ckpts.save({"step": 12}, step=12, is_writer=True, barrier=lambda: None)
    assert not stale.exists()  # cleaned by the next save
    assert CheckpointDir(tmp_path / "empty").load_latest() == (None, None)


def test_non_writer_writes_nothing_but_still_reaches_the_barrier(tmp_path):
    reached = []
    out = save_checkpoint(tmp_path / "c.pt", {"w": torch.ones(1)}, is_writer=False,
                          barrier=lambda: reached.append(True))
    assert out is None and reached == [True] and not any(tmp_path.iterdir())


def test_rng_state_round_trips_through_a_checkpoint_file(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)  # noqa: NPY002 (the global generators are what we checkpoint)
    random.seed(3)
    saved = rng_state()
    write_atomically(tmp_path / "rng.pt", {"rng": saved})
    expected = (torch.rand(3), np.random.rand(3), random.random())  # noqa: NPY002
    torch.manual_seed(99)
    np.random.seed(99)  # noqa: NPY002
    random.seed(99)
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())  # noqa: NPY002
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_restore_training_state_rejects_foreign_checkpoints():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="x.pt: not a training checkpoint"):
        restore_training_state({"model": {}}, model, opt, source="x.pt")
    state = capture_training_state(torch.nn.Linear(3, 2), opt, epoch=0, batch_in_epoch=0,
                                   step=0)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        restore_training_state(state, model, opt, source="y.pt")


def test_xla_training_state_resumes_bit_identically(tmp_path):
    """Model + AdamW + XLA RNG (dropout) saved after step 3 and restored into fresh
    objects continue exactly like the original (the in-process version of the kill test)."""
    import torch_xla

    from course.models import DigitsCNN

    device = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))
               for _ in range(6)]

    def make():
        torch.manual_seed(0)
        model = DigitsCNN().to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
        torch_xla.sync()

    import torch_xla.core.xla_model as xm

    xm.set_rng_state(123)
    model, opt = make()
    for x, y in batches[:3]:
        step(model, opt, x, y)
    save_checkpoint(tmp_path / "k.pt", capture_training_state(
        model, opt, epoch=0, batch_in_epoch=3, step=3), is_writer=True)
    for x, y in batches[3:]:
        step(model, opt, x, y)
    reference = {k: v.cpu() for k, v in model.state_dict().items()}

    xm.set_rng_state(777)  # clobber the RNG: the checkpoint must put it back
    model2, opt2 = make()
    where = restore_training_state(load_checkpoint(tmp_path / "k.pt"), model2, opt2)
    assert (where.epoch, where.batch_in_epoch, where.step) == (0, 3, 3)
    for x, y in batches[3:]:
        step(model2, opt2, x, y)
    for k, v in model2.state_dict().items():
        assert torch.equal(v.cpu(), reference[k]), k


def test_every_rank_saves_only_rank0_writes_and_best_comes_from_the_reduced_metric(tmp_path):
    """Two real processes (torch.distributed gloo): both call save with the same state;
    rank 0 writes; "best" is decided from an all-reduced accuracy, so both agree."""
    decisions_dir = tmp_path.with_name(tmp_path.name + "_ranks")
    decisions_dir.mkdir()
    code = f"""
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from tpu_helpers.checkpoint import CheckpointDir

    def rank_main(rank):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{29500 + os.getpid() % 1000}",
                                rank=rank, world_size=2)
        ckpts = CheckpointDir({str(tmp_path)!r}, keep=None)
        best, decisions = None, []
        for epoch, local_acc in enumerate([[0.50, 0.70], [0.80, 0.40], [0.90, 0.85]]):
            acc = torch.tensor(local_acc[rank])
            dist.all_reduce(acc)                      # the reduced metric: same everywhere
            acc = float(acc) / 2
            improved = best is None or acc > best
            best = acc if improved else best
            decisions.append(improved)
            state = {{"epoch": epoch, "acc": acc, "written_by": rank,
                      "w": torch.full((3,), float(epoch))}}
            ckpts.save(state, step=epoch, is_writer=rank == 0, barrier=dist.barrier)
            if improved:
                ckpts.save_best(state, is_writer=rank == 0, barrier=dist.barrier)
        # one file per rank: two processes printing to one pipe can interleave their lines
        with open(os.path.join({str(decisions_dir)!r}, f"rank{{rank}}.json"), "w") as f:
            json.dump({{"rank": rank, "decisions": decisions}}, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.start_processes(rank_main, nprocs=2, start_method="fork")
    """
    run_python(code, timeout=120)
    import json

    lines = [json.loads(p.read_text()) for p in sorted(decisions_dir.glob("rank*.json"))]
    assert sorted(d["rank"] for d in lines) == [0, 1]
    assert lines[0]["decisions"] == lines[1]["decisions"] == [True, False, True]
    ckpts = CheckpointDir(tmp_path)
    assert ckpts.steps() == [0, 1, 2]
    assert {load_checkpoint(ckpts.path_for(s))["written_by"] for s in (0, 1, 2)} == {0}
    best = load_checkpoint(ckpts.best_path)
    assert best["epoch"] == 2 and best["acc"] == pytest.approx(0.875)
    assert not [p for p in tmp_path.iterdir() if TEMP_MARKER in p.name]


KILL_DURING_SAVE = """
import sys, torch
from tpu_helpers.checkpoint import CheckpointDir
ckpts = CheckpointDir(sys.argv[1], keep=None)
small = {"version": 1, "w": torch.ones(4)}
ckpts.save(small, step=1, is_writer=True, barrier=lambda: None)
ckpts.save_best(small, is_writer=True, barrier=lambda: None)
print("saved v1", flush=True)
# ~400 MB in many tensors: long enough to be caught in the middle of writing
big = {"version": 2, "w": [torch.full((1_000_000,), float(i)) for i in range(100)]}
ckpts.save_best(big, is_writer=True, barrier=lambda: None)
ckpts.save(big, step=2, is_writer=True, barrier=lambda: None)
print("saved v2", flush=True)
"""


def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    # best.pt is being overwritten with ~400 MB when the kill lands
    proc, temp = kill_mid_write(tmp_path, KILL_DURING_SAVE, ready="saved v1",
                                min_bytes=1_000_000, marker=TEMP_MARKER)
    assert proc.returncode == -signal.SIGKILL
    assert temp and temp[0].name.startswith("best.pt"), "the kill did not land mid-save"
    ckpts = CheckpointDir(tmp_path)
    best = load_checkpoint(ckpts.best_path)  # the old best.pt, intact
    assert best["version"] == 1 and torch.equal(best["w"], torch.ones(4))
    state, path = ckpts.load_latest()
    assert path == ckpts.path_for(1) and state["version"] == 1
    assert ckpts.steps() == [1]  # the half-written file never got a checkpoint name
    ckpts.save({"version": 3}, step=3, is_writer=True, barrier=lambda: None)
    assert not [p for p in tmp_path.iterdir() if TEMP_MARKER in p.name]


def test_writer_choice():
    """One replica here (world size 1): it writes for both kinds of storage."""
    import torch_xla

    from tpu_helpers.checkpoint import is_checkpoint_writer

    with pytest.raises(ValueError, match="storage"):
        is_checkpoint_writer("nfs")
    torch_xla.device()
    assert is_checkpoint_writer("shared") and is_checkpoint_writer("local")
