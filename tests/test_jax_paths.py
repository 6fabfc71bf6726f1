"""The code paths torch_xla takes when jax is importable, as on Colab's and Kaggle's TPU images
(jax 0.7.2 beside torch_xla 2.9 / 2.8, and flax: ``requirements-jax-lane.txt``). Each test runs
a fresh Python with 4 virtual XLA:CPU devices under SPMD and real torch_xla and jax.

Skipped when jax is not importable (the main lines); the jax lane (``make test-jax``, which puts
the overlay on PYTHONPATH and sets ``JAX_LANE=1``) runs them on both lines and fails instead of
skipping if jax is missing there.

What changes with jax, and what is pinned here:
* ``xs.mark_sharding`` imports torch_xla's bundled ``torchax`` (``maybe_get_torchax``), which
  renames torch's ``privateuse1`` backend to ``"jax"`` (2.8 always; 2.9 only with flax, which its
  torchax imports); the annotation itself is unchanged. 2.9 also sets
  ``jax_use_shardy_partitioner=False``; 2.8 does not, and 2.8 without jax logs a notice instead.
* ``dist_cp.save`` with the default ``FileSystemWriter`` then fails (``current_stream``);
  ``tpu_helpers.sharded_checkpoint.xla_storage_writer`` / ``save_sharded_checkpoint`` do not.
* ``xs.shard_as`` (``jax.experimental.shard_alike``) and so ``scan_layers``' backward under SPMD:
  fine on 2.9 with flax; on 2.8 XLA's partitioner refuses jax 0.7.2's Shardy op until
  ``tpu_helpers.spmd.jax_lowers_for_gspmd()``; then the gradients equal the unrolled loop's.
* the Pallas ``flash_attention`` refuses XLA:CPU (TPU only); ``xp.Trace`` enters a jax scope.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from conftest import run_python

if importlib.util.find_spec("jax") is None:
    if os.environ.get("JAX_LANE") == "1":
        raise RuntimeError("the jax lane runs without jax: is .jax-overlay on PYTHONPATH?")
    pytest.skip("jax is not importable here: these tests run in the jax lane (make test-jax)",
                allow_module_level=True)

ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "JAX_PLATFORMS": "cpu"}

PRELUDE = """
import importlib.util, json, logging, sys
import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()
LINE = torch_xla.__version__[:3]
FLAX = importlib.util.find_spec("flax") is not None
mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))
dev = torch_xla.device()
out = {"line": LINE, "flax": FLAX}
"""


def probe(code: str) -> dict:
    proc = run_python(PRELUDE + code + "\nprint('RESULT ' + json.dumps(out))\n", env=ENV)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def torchax_expected(out: dict) -> bool:
    """torch_xla 2.8's torchax imports with jax alone; 2.9's also needs flax."""
    return out["line"] == "2.8" or out["flax"]


def test_mark_sharding_imports_torchax_which_renames_privateuse1_but_annotates_the_same():
    out = probe("""
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger().addHandler(Keep())
before = torch._C._get_privateuse1_backend_name()
t = torch.zeros(8, 4, device=dev)
xs.mark_sharding(t, mesh, ("fsdp", None))
import jax
out.update(before=before, after=torch._C._get_privateuse1_backend_name(),
           torchax="torchax" in sys.modules, spec=torch_xla._XLAC._get_xla_sharding_spec(t),
           shardy=bool(jax.config.jax_use_shardy_partitioner),
           notices=sum("requires jax/pallas" in m for m in records))
""")
    print(out)
    assert out["before"] == "privateuseone"
    assert out["torchax"] is torchax_expected(out)
    assert out["after"] == ("jax" if torchax_expected(out) else "privateuseone")
    assert out["spec"] == "{devices=[4,1]0,1,2,3}"   # the annotation does not change
    assert out["shardy"] is (out["line"] == "2.8")    # 2.9 turns Shardy off, 2.8 does not
    assert out["notices"] == 0                        # 2.8's "requires jax" notice: no-jax only


def test_default_dist_cp_writer_fails_after_torchax_and_the_toolkit_saves():
    out = probe("""
import tempfile
import torch.distributed.checkpoint as dist_cp
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner
from tpu_helpers.sharded_checkpoint import (load_sharded_checkpoint, save_sharded_checkpoint,
                                            xla_storage_writer)
w = torch.arange(32.0).reshape(8, 4).to(dev)
xs.mark_sharding(w, mesh, ("fsdp", None))
out["privateuse1"] = torch._C._get_privateuse1_backend_name()
root = tempfile.mkdtemp()
try:
    dist_cp.save({"w": w}, storage_writer=dist_cp.FileSystemWriter(root + "/default"),
                 planner=SPMDSavePlanner(), no_dist=True)
    out["default"] = "saved"
except BaseException as exc:
    out["default"] = f"{type(exc).__name__}: {exc}"
dist_cp.save({"w": w}, storage_writer=xla_storage_writer(root + "/fixed"),
             planner=SPMDSavePlanner(), no_dist=True)
back = torch.zeros(8, 4).to(dev)
xs.mark_sharding(back, mesh, ("fsdp", None))
dist_cp.load({"w": back}, storage_reader=dist_cp.FileSystemReader(root + "/fixed"),
             planner=SPMDLoadPlanner(), no_dist=True)
again = torch.zeros(8, 4).to(dev)
xs.mark_sharding(again, mesh, ("fsdp", None))
load_sharded_checkpoint({"w": again}, save_sharded_checkpoint({"w": w}, root + "/toolkit"))
out["fixed_equal"] = torch.equal(back.cpu(), w.cpu())
out["toolkit_equal"] = torch.equal(again.cpu(), w.cpu())
out["spec_kept"] = torch_xla._XLAC._get_xla_sharding_spec(again)
""")
    print(out)
    if out["privateuse1"] == "jax":   # Kaggle's pair, and Colab's (flax)
        assert "'torchax.device_module' has no attribute 'current_stream'" in out["default"]
    else:                             # 2.9 with jax but no flax: torchax did not import
        assert out["default"] == "saved"
    assert out["privateuse1"] == ("jax" if torchax_expected(out) else "privateuseone")
    assert out["fixed_equal"] and out["toolkit_equal"]
    assert out["spec_kept"] == "{devices=[4,1]0,1,2,3}"


SHARD_AS = """
from tpu_helpers.spmd import jax_lowers_for_gspmd
if FIX:
    out["fix"] = jax_lowers_for_gspmd()
a, b = torch.randn(8, 4, device=dev), torch.randn(8, 4, device=dev)
xs.mark_sharding(b, mesh, ("fsdp", None))
try:
    a2, b2 = xs.shard_as(a, b)
    c = a2 + b2
    torch_xla.sync()
    out["shard_as"] = torch_xla._XLAC._get_xla_sharding_spec(a2)
except Exception as exc:
    out["shard_as"] = f"{type(exc).__name__}: {exc}"[:300]
"""


@pytest.mark.parametrize("fix", [False, True], ids=["as-shipped", "jax_lowers_for_gspmd"])
def test_shard_as_needs_gspmd_lowering_on_2_8(fix):
    out = probe(f"FIX = {fix}\n" + SHARD_AS)
    print(out)
    if not torchax_expected(out):     # 2.9 without flax: call_jax needs torchax
        assert "Jax is required for this feature" in out["shard_as"]
    elif out["line"] == "2.8" and not fix:
        assert "Side-effect HLO must have sharding" in out["shard_as"], out["shard_as"]
        assert "xla.sdy.ShardingGroup" in out["shard_as"]
    else:
        assert out["shard_as"] == "{devices=[4,1]0,1,2,3}"   # a took b's sharding
    if fix:   # called before any mark_sharding: jax 0.7.2's default (Shardy on) is turned off
        assert out["fix"] == "jax 0.7.2: jax_use_shardy_partitioner True -> False"


def test_scan_layers_backward_under_spmd_equals_the_loop_with_jax():
    out = probe("""
from torch_xla.experimental.scan_layers import scan_layers
from tpu_helpers.spmd import jax_lowers_for_gspmd
out["fix"] = jax_lowers_for_gspmd()
torch.manual_seed(0)
layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)]).to(dev)
for layer in layers:
    xs.mark_sharding(layer.weight, mesh, ("fsdp", None))
x = torch.randn(4, 8, device=dev)
try:
    scan_layers(layers, x).sum().backward()
    torch_xla.sync()
    scanned = [layer.weight.grad.cpu().clone() for layer in layers]
    for layer in layers:
        layer.weight.grad = None
    y = x
    for layer in layers:
        y = layer(y)
    y.sum().backward()
    torch_xla.sync()
    out["gap"] = max(float((g - layer.weight.grad.cpu()).abs().max())
                     for g, layer in zip(scanned, layers))
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"[:300]
""")
    print(out)
    if not torchax_expected(out):
        assert "Jax is required for this feature" in out["error"]
    else:
        assert out["gap"] < 1e-5, out   # scan's backward = the unrolled loop's (XLA:CPU fp32)


def test_pallas_flash_attention_refuses_xla_cpu_and_the_profiler_scope_enters_jax():
    out = probe("""
import torch_xla.debug.profiler as xp
from torch_xla.experimental.custom_kernel import flash_attention
q = torch.randn(1, 2, 128, 64, device=dev)
try:
    flash_attention(q, q, q, causal=True).cpu()
    out["flash"] = "ran"
except Exception as exc:
    out["flash"] = f"{type(exc).__name__}: {exc}"[:200]
trace = xp.Trace("step")
with trace:
    out["jax_scope"] = trace._jax_scope is not None
""")
    print(out)
    assert out["flash"] == "ValueError: Only interpret mode is supported on CPU backend."
    assert out["jax_scope"]   # xp.Trace also enters jax.named_scope when jax imports
