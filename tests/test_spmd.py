"""tpu_helpers.spmd (mesh shapes, the sharding annotation, shard placements, sharding summary)
and tpu_helpers.sharded_checkpoint (sharded checkpoints).

The pure parts run here; everything that needs 4 devices and SPMD runs once in a fresh
Python (``CPU_NUM_DEVICES=4``; this test process has one device) whose JSON report the
tests below check against torch_xla's own view of the shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import run_python

from tpu_helpers.sharded_checkpoint import _first_gap
from tpu_helpers.spmd import mesh_shapes, resolve_mesh_shape, shard_placements

# --------------------------------------------------------------------------- pure


def test_mesh_shapes_lists_every_factorisation():
    assert mesh_shapes(4, 1) == [(4,)]
    assert mesh_shapes(4, 2) == [(1, 4), (2, 2), (4, 1)]
    assert mesh_shapes(8, 2) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert len(mesh_shapes(8, 3)) == 10
    assert all(a * b * c == 8 for a, b, c in mesh_shapes(8, 3))
    with pytest.raises(ValueError):
        mesh_shapes(0, 2)


@pytest.mark.parametrize("names, shape, expected", [
    (("data",), None, (4,)),
    (("data", "model"), None, (4, 1)),
    (("fsdp", "model"), (2, 2), (2, 2)),
    (("fsdp", "model"), (-1, 2), (2, 2)),
    (("data", "fsdp", "model"), (1, -1, 1), (1, 4, 1)),
])
def test_resolve_mesh_shape_good(names, shape, expected):
    assert resolve_mesh_shape(4, names, shape) == expected


@pytest.mark.parametrize("names, shape, words", [
    (("data", "model"), (2, 4), "needs 8 devices; 4 are available"),
    (("data", "model"), (4,), "has 1 axes but names"),
    (("data", "model"), (-1, -1), "at most one -1"),
    (("data", "model"), (0, 4), "sizes must be >= 1"),
    (("data", "model"), (-1, 3), "do not divide by 3"),
    (("data", "data"), (2, 2), "distinct"),
])
def test_resolve_mesh_shape_bad_names_the_shapes_that_fit(names, shape, words):
    with pytest.raises(ValueError) as err:
        resolve_mesh_shape(4, names, shape)
    assert words in str(err.value)
    if "distinct" not in words:
        assert "(1, 4), (2, 2), (4, 1)" in str(err.value)


def _bounds(places):
    return [(p.device, p.bounds, p.padded_shape) for p in places]


def test_shard_placements_tiled_with_replicated_last_dim():
    places = shard_placements("{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}", (10, 6), 4)
    assert _bounds(places) == [
        (0, ((0, 5), (0, 6)), (5, 6)), (1, ((5, 10), (0, 6)), (5, 6)),
        (2, ((0, 5), (0, 6)), (5, 6)), (3, ((5, 10), (0, 6)), (5, 6)),
    ]


def test_shard_placements_uneven_shards_are_padded():
    places = shard_placements("{devices=[1,4]0,1,2,3}", (8, 5), 4)
    assert [p.shape for p in places] == [(8, 2), (8, 2), (8, 1), (8, 0)]
    assert {p.padded_shape for p in places} == {(8, 2)}


def test_shard_placements_iota_forms_and_replicated():
    assert _bounds(shard_placements("{devices=[4]<=[4]}", (8,), 4)) == [
        (d, ((2 * d, 2 * d + 2),), (2,)) for d in range(4)]
    # <=[2,2]T(1,0): tile (i, j) is on device 2*j + i
    places = shard_placements("{devices=[2,2]<=[2,2]T(1,0)}", (4, 4), 4)
    assert [(p.device, p.bounds) for p in places] == [
        (0, ((0, 2), (0, 2))), (1, ((2, 4), (0, 2))), (2, ((0, 2), (2, 4))),
        (3, ((2, 4), (2, 4)))]
    for spec in ("", "{replicated}"):
        assert _bounds(shard_placements(spec, (3, 2), 4)) == [
            (d, ((0, 3), (0, 2)), (3, 2)) for d in range(4)]


@pytest.mark.parametrize("spec, shape, words", [
    ("{maximal device=0}", (4,), "not tiled or replicated"),
    ("{devices=[2,2]0,1,2,3}", (4,), "tiles 2 dims"),
    ("{devices=[4]0,1,2}", (4,), "3 device ids"),
    ("{devices=[4]0,1,1,3}", (4,), "each of 4 devices once"),
    ("{devices=[2]0,1}", (4,), "uses 2 devices, not 4"),
])
def test_shard_placements_rejects_what_it_cannot_read(spec, shape, words):
    with pytest.raises(ValueError, match=words):
        shard_placements(spec, shape, 4)


def test_first_gap_finds_what_no_saved_chunk_holds():
    # the loader's check that the saved chunks hold every element it reads (no partial load)
    tiles = [((0, 4), (0, 3)), ((0, 4), (3, 6)), ((4, 8), (0, 6))]
    assert _first_gap(((0, 8), (0, 6)), tiles) is None
    assert _first_gap(((0, 8), (0, 6)), tiles[:2]) == (4, 0)
    assert _first_gap(((2, 6), (1, 5)), [((0, 6), (0, 2)), ((0, 8), (2, 6))]) is None
    assert _first_gap(((0, 3),), [((0, 1),), ((2, 3),)]) == (1,)
    assert _first_gap((), [()]) is None and _first_gap((), []) == ()
    assert _first_gap(((0, 0), (0, 5)), []) is None  # nothing to load


# --------------------------------------------------------------------------- 4 devices

SPMD_SCRIPT = r"""
import json, os, tempfile
import matplotlib
matplotlib.use("Agg")
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
from torch import nn
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2)
import warnings
counted_before = xr.global_runtime_device_count()  # querying the runtime before is fine
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    xr.use_spmd()
from course.plots import plot_shard_layout
from tpu_helpers.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from tpu_helpers.spmd import device_mesh, sharding_summary

out = {"devices": xr.global_runtime_device_count(), "counted_before": counted_before,
       "use_spmd_warnings": [str(w.message) for w in caught]}
out["mesh_default"] = list(device_mesh(("data", "model")).mesh_shape)
out["mesh_fsdp"] = list(device_mesh(("fsdp", "model"), (-1, 2)).mesh_shape)
try:
    device_mesh(("data", "model"), (4, 4))
except ValueError as e:
    out["mesh_bad"] = str(e)

mesh = device_mesh(("data", "model"), (2, 2))
dev = torch_xla.device()
ts = {"w": torch.randn(10, 6), "c": torch.randn(8, 8), "e": torch.randn(8, 5), "r": torch.randn(3)}
ts = {k: v.to(dev) for k, v in ts.items()}
xs.mark_sharding(ts["w"], mesh, ("model", None))
xs.mark_sharding(ts["c"], mesh, ("data", "model"))
xs.mark_sharding(ts["e"], mesh, (None, ("data", "model")))
out["summary"] = sharding_summary(ts)
# torch_xla's own view: the device buffers (copied to the host here, which the summary avoids)
sharded = ["w", "c", "e"]
shards = torch_xla._XLAC._get_local_shards([ts[k] for k in sharded])
out["xla_shard_bytes"] = {k: [d.numel() * d.element_size() for d, _ in s]
                          for k, s in zip(sharded, shards)}
out["xla_shard_devices"] = {k: [dv for _, dv in s] for k, s in zip(sharded, shards)}
idx = torch_xla._XLAC._get_local_shard_replica_and_indices([ts[k] for k in sharded])
out["xla_indices"] = {k: [[[s.start, s.stop] for s in i] for _, i in s]
                      for k, s in zip(sharded, idx)}
from tpu_helpers.spmd import shard_placements
out["our_indices"] = {k: [[list(b) for b in p.bounds] for p in shard_placements(
    torch_xla._XLAC._get_xla_sharding_spec(ts[k]), ts[k].shape, 4)] for k in sharded}
from tpu_helpers.spmd import sharding_spec
out["public_spec_equal"] = {k: sharding_spec(v) == torch_xla._XLAC._get_xla_sharding_spec(v)
                            for k, v in ts.items()}
out["specs"] = {k: sharding_spec(v) for k, v in ts.items()}
out["cpu_spec"] = sharding_spec(torch.zeros(2))

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 12)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

fsdp_mesh = device_mesh(("fsdp",))
torch.manual_seed(0)
a = FSDPv2(MLP(), mesh=fsdp_mesh)
fs = sharding_summary(a)
out["fsdp_fraction"] = sum(r["bytes/device"] for r in fs) / sum(r["bytes"] for r in fs)
fig = plot_shard_layout(a, "FSDPv2")
out["plot_axes"] = len(fig.axes)
out["plot_title"] = fig._suptitle.get_text()
out["plot_labels"] = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
batch = torch.zeros(8, 64).to(dev)
xs.mark_sharding(batch, fsdp_mesh, ("fsdp", None))
fig = plot_shard_layout(a, "FSDPv2", inputs={"batch": batch})
out["plot_inputs_title"] = fig._suptitle.get_text()
out["plot_inputs_labels"] = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
out["plot_inputs_texts"] = [t.get_text() for t in fig.axes[0].texts]
# under SPMD every execution is counted in ExecuteReplicatedTime, none in ExecuteTime
xm.wait_device_ops()  # executions are asynchronous: count only finished ones
before = (met.metric_data("ExecuteReplicatedTime") or [0])[0]
a(torch.ones(8, 64, device=dev)).sum().item()
xm.wait_device_ops()
out["executions"] = {"replicated": (met.metric_data("ExecuteReplicatedTime") or [0])[0] - before,
                     "plain": met.metric_data("ExecuteTime")}

root = tempfile.mkdtemp()
ck = os.path.join(root, "ck")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    save_sharded_checkpoint(a.state_dict(), ck)
out["save_warnings"] = [str(w.message)[:80] for w in caught]
save_sharded_checkpoint(a.state_dict(), ck)  # overwrite in place
out["ck_listing"] = sorted(os.listdir(root))
out["ck_files"] = sorted(os.listdir(ck))
torch.manual_seed(1)
b = FSDPv2(MLP(), mesh=fsdp_mesh)
out["differs_before"] = any(not torch.equal(p.cpu(), q.cpu())
                            for p, q in zip(a.parameters(), b.parameters()))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    load_sharded_checkpoint(b.state_dict(), ck)
out["load_warnings"] = [str(w.message)[:80] for w in caught]
out["equal_after"] = all(torch.equal(p.cpu(), q.cpu())
                         for p, q in zip(a.parameters(), b.parameters()))
spec = torch_xla._XLAC._get_xla_sharding_spec
out["specs_kept"] = all(spec(p) == spec(q) for p, q in zip(a.parameters(), b.parameters()))
errors = {}
for name, fn in [
    ("missing", lambda: load_sharded_checkpoint(b.state_dict(), os.path.join(root, "nope"))),
    ("extra_key", lambda: load_sharded_checkpoint({**b.state_dict(), "x": torch.zeros(2)}, ck)),
    ("shape", lambda: load_sharded_checkpoint({"_orig_module.fc1.bias": torch.zeros(3)}, ck)),
]:
    try:
        fn()
    except Exception as e:
        errors[name] = [type(e).__name__, str(e)]
out["errors"] = errors
print("JSON" + json.dumps(out, default=list))
"""


@pytest.fixture(scope="module")
def spmd_report() -> dict:
    proc = run_python(SPMD_SCRIPT, env={"CPU_NUM_DEVICES": "4", "TF_CPP_MIN_LOG_LEVEL": "2"})
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    return json.loads(line[4:])


def test_device_mesh_on_four_devices(spmd_report):
    assert spmd_report["devices"] == 4 == spmd_report["counted_before"]
    assert spmd_report["use_spmd_warnings"] == []  # no tensor was on the device yet
    assert spmd_report["mesh_default"] == [4, 1]
    assert spmd_report["mesh_fsdp"] == [2, 2]
    assert "needs 16 devices; 4 are available" in spmd_report["mesh_bad"]


def test_sharding_summary_bytes_match_the_device_buffers(spmd_report):
    rows = {r["tensor"]: r for r in spmd_report["summary"]}
    # w: 10x6 float32 split in 2 along rows, each half on 2 devices
    assert rows["w"]["bytes"] == 240 and rows["w"]["bytes/device"] == 120
    assert rows["w"]["copies"] == 2
    assert rows["c"]["bytes/device"] == 64 and rows["c"]["copies"] == 1
    # e: 5 columns over 4 devices -> padded to 2 columns each: 8*2*4 bytes per device
    assert rows["e"]["bytes/device"] == 64
    assert rows["r"]["copies"] == 4 and rows["r"]["fraction"] == 1.0
    for name, per_device in spmd_report["xla_shard_bytes"].items():
        assert per_device == [rows[name]["bytes/device"]] * 4, name
        assert spmd_report["xla_shard_devices"][name] == [f"CPU:{d}" for d in range(4)]


def test_shard_placements_agree_with_torch_xla(spmd_report):
    assert spmd_report["our_indices"] == spmd_report["xla_indices"]


def test_sharding_spec_is_the_public_view_of_the_annotation(spmd_report):
    # XLAShardedTensor(t).sharding_spec (public) reads what _XLAC._get_xla_sharding_spec does
    assert all(spmd_report["public_spec_equal"].values())
    assert spmd_report["specs"]["w"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    assert spmd_report["specs"]["r"] == "" and spmd_report["cpu_spec"] == ""


def test_split_words_names_the_split_dims():
    from course.plots import split_words
    assert split_words((256, 64), (64, 64)) == "rows / 4"
    assert split_words((10, 256), (10, 64)) == "columns / 4"
    assert split_words((10,), (3,)) == "dim 0 / 4"
    assert split_words((8, 8), (4, 4)) == "rows / 2, columns / 2"
    assert split_words((10,), (10,)) == "whole"


def test_shard_plot_with_inputs_says_what_each_device_holds(spmd_report):
    # notebook 07's figures: the batch row makes tensor parallel and FSDPv2 differ visibly
    assert spmd_report["plot_inputs_title"] == (
        "FSDPv2\neach of 4 devices holds 25% of the parameters and 25% of batch")
    labels = spmd_report["plot_inputs_labels"]
    assert labels[0] == "batch\n8x64\nrows / 4"
    assert labels[1] == "fc1.weight\n256x64\nrows / 4"
    assert labels[3] == "fc2.weight\n12x256\ncolumns / 4"
    assert spmd_report["plot_inputs_texts"] == ["2x64\n512 B"]  # device 0's shard, bytes


def test_sharded_checkpoint_calls_show_no_warnings(spmd_report):
    # dist_cp's informational warnings (single process, planner signature, TypedStorage,
    # torch_xla's list index) stay inside tpu_helpers.sharded_checkpoint: a learner sees none
    assert spmd_report["save_warnings"] == []
    assert spmd_report["load_warnings"] == []


def test_fsdpv2_holds_a_quarter_per_device(spmd_report):
    assert spmd_report["fsdp_fraction"] == pytest.approx(0.25, abs=1e-9)
    assert spmd_report["plot_axes"] == 4 * 4


def test_shard_plot_title_says_what_it_shows_with_clean_names(spmd_report):
    assert spmd_report["plot_title"] == (
        "FSDPv2\neach of 4 devices holds 25% of the parameters")
    assert [label.split("\n")[0] for label in spmd_report["plot_labels"]] == [
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_spmd_executions_are_counted_as_replicated(spmd_report):
    assert spmd_report["executions"]["replicated"] == 1
    assert spmd_report["executions"]["plain"] is None


def test_sharded_checkpoint_round_trip(spmd_report):
    assert spmd_report["ck_listing"] == ["ck"]  # no temp or old folders left behind
    assert ".metadata" in spmd_report["ck_files"]
    assert spmd_report["differs_before"]
    assert spmd_report["equal_after"]
    assert spmd_report["specs_kept"]


def test_sharded_checkpoint_bad_input_is_named(spmd_report):
    errors = spmd_report["errors"]
    assert errors["missing"][0] == "FileNotFoundError" and "nope" in errors["missing"][1]
    assert errors["extra_key"][0] == "KeyError" and "'x'" in errors["extra_key"][1]
    assert errors["shape"][0] == "ValueError"
    assert "fc1.bias" in errors["shape"][1] and "(256,)" in errors["shape"][1]


LATE_SPMD = r"""
import resource, warnings
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the crash below leaves no core file
import torch, torch_xla, torch_xla.runtime as xr
t = torch.ones(4, device=torch_xla.device())   # the device is used before SPMD mode
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    xr.use_spmd()
print("WARN" + " | ".join(str(w.message) for w in caught), flush=True)
print("SUM", (torch.ones(4, device=torch_xla.device()) * 2).sum().item(), flush=True)
"""


def test_late_use_spmd_warns_then_the_next_computation_crashes_on_xla_cpu():
    # Same Python source in 2.8 and 2.9 (runtime.use_spmd): it forces SPMD mode with a
    # warning. On XLA:CPU the first computation after it kills the process (a segfault
    # in 2.8 and 2.9), which notebook 07 says; if this starts to pass, update the notebook.
    proc = run_python(LATE_SPMD, env={"CPU_NUM_DEVICES": "4", "TF_CPP_MIN_LOG_LEVEL": "2"},
                      check=False)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("WARN"))
    assert "Replicating tensors already initialized on non-virtual XLA device" in line
    assert proc.returncode != 0 and "SUM" not in proc.stdout


GSPMD_NOTICE = r"""
import os, sys
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
if sys.argv[1:] == ["quiet"]:  # as notebook 07's config cell: set before the runtime starts
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
xr.use_spmd()
mesh = xs.Mesh(np.arange(4), (4,), ("data",))
x = torch.ones(8, 4).to(torch_xla.device())
xs.mark_sharding(x, mesh, ("data", None))
print("SUM", (x * 2).sum().item(), flush=True)
"""


@pytest.mark.parametrize("mode", ["default", "quiet"])
def test_gspmd_deprecation_notice_and_how_notebook_07_hides_it(tmp_path, mode):
    # torch_xla 2.9's XLA warns on every SPMD compile that GSPMD propagation will be deprecated
    # (in favour of Shardy; 2.8's XLA predates the notice); torch_xla 2.8 and 2.9 partition with
    # GSPMD. TF_CPP_MIN_LOG_LEVEL=2, set before the first C++ log line, hides C++ warnings;
    # torch_xla's default is 1.
    import torch_xla
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    script = tmp_path / "gspmd.py"
    script.write_text(GSPMD_NOTICE)
    proc = subprocess.run([sys.executable, str(script), *(["quiet"] if mode == "quiet" else [])],
                          env={**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"},
                          capture_output=True, text=True, timeout=300)
    assert "SUM 64.0" in proc.stdout, proc.stderr[-2000:]
    notice = "GSPMD sharding propagation is going to be deprecated"
    shown = mode == "default" and not torch_xla.__version__.startswith("2.8")
    assert (notice in proc.stderr) == shown, proc.stderr[-2000:]
