"""The TPU-numerics emulation of the CI lane (scripts/tpu_numerics), checked in fresh Pythons
with ``TPU_NUMERICS=1`` and real torch_xla on XLA:CPU: XLA matmuls, convolutions and their
gradients equal CPU fp32 computed on bfloat16-rounded inputs, per matmul precision; CPU tensors
are untouched; every kind of process (forked, spawned, launched replicas) is covered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

LANE = REPO / "scripts" / "tpu_numerics"
SITE = REPO / "scripts" / "lanes"  # the lanes' sitecustomize


def emulated(code: str, folder: Path, *, on: bool = True, extra_path: str = "",
             timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script in ``folder`` in a fresh Python with the lane's environment
    (``check=False``: a failure is left to the tests that read its output)."""
    script = folder / "probe.py"
    script.write_text(textwrap.dedent(code))
    path = os.pathsep.join(p for p in (str(REPO), str(SITE), str(LANE), extra_path) if p)
    env = {**os.environ, "PYTHONPATH": path, "TPU_NUMERICS": "1" if on else "0",
           "TPU_NUMERICS_DIR": str(folder / "proof"), "PJRT_DEVICE": "CPU"}
    proc = subprocess.run([sys.executable, str(script)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: Run inside PROBES' lane-on process (after its TOLERANCE line, before scan_layers); counts
#: its own matmuls only.
NUMERICS = """
import json
import torch, torch_xla, torch_xla.backends
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight
import tpu_numerics

r = lambda t: t.bfloat16().float()
def hi_lo(t):
    h = r(t)
    return h, r(t - h)
gap = lambda a, b: (a - b).abs().max().item()
dev = torch_xla.device()
torch.manual_seed(0)
a, b = torch.randn(64, 48), torch.randn(48, 32)
w, bias = torch.randn(8, 48), torch.randn(8)
x, k, kb = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3), torch.randn(4)
c = torch.randn(2, 4, 7, 7)  # upstream gradients: not representable in bfloat16
g = torch.randn(64, 8)
out = {"active": tpu_numerics.active()}
assert torch_xla.backends.get_mat_mul_precision() == "default"
start = tpu_numerics.count()

mm = (a.to(dev) @ b.to(dev)).cpu()
out["mm_vs_rounded"], out["mm_vs_exact"] = gap(mm, r(a) @ r(b)), gap(mm, a @ b)
lin = F.linear(a.to(dev), w.to(dev), bias.to(dev)).cpu()
out["linear_vs_rounded"] = gap(lin, F.linear(r(a), r(w), bias))  # the bias is not rounded
out["linear_vs_exact"] = gap(lin, F.linear(a, w, bias))
xd, kd, kbd = (t.to(dev).requires_grad_() for t in (x, k, kb))
y = F.conv2d(xd, kd, kbd)
(y * c.to(dev)).sum().backward()
out["conv_vs_rounded"] = gap(y.detach().cpu(), F.conv2d(r(x), r(k), kb))
out["conv_vs_exact"] = gap(y.detach().cpu(), F.conv2d(x, k, kb))
out["dinput_vs_rounded"] = gap(xd.grad.cpu(), conv2d_input(x.shape, r(k), r(c)))
out["dinput_vs_exact"] = gap(xd.grad.cpu(), conv2d_input(x.shape, k, c))
out["dweight_vs_rounded"] = gap(kd.grad.cpu(), conv2d_weight(r(x), k.shape, r(c)))
out["dbias_vs_exact"] = gap(kbd.grad.cpu(), c.sum((0, 2, 3)))  # a sum: not a matmul
ad = a.to(dev).requires_grad_()
(F.linear(ad, w.to(dev)) * g.to(dev)).sum().backward()
out["dlinear_vs_rounded"] = gap(ad.grad.cpu(), r(g) @ r(w))
out["count_default"] = tpu_numerics.count() - start

torch_xla.backends.set_mat_mul_precision("high")
high = (a.to(dev) @ b.to(dev)).cpu()
(ah, al), (bh, bl) = hi_lo(a), hi_lo(b)
out["high_vs_3pass"] = gap(high, ah @ bh + ah @ bl + al @ bh)
out["high_vs_exact"] = gap(high, a @ b)
xd, kd, kbd = (t.to(dev).requires_grad_() for t in (x, k, kb))
(F.conv2d(xd, kd, kbd) * c.to(dev)).sum().backward()
out["high_dbias_vs_exact"] = gap(kbd.grad.cpu(), c.sum((0, 2, 3)))  # not tripled
out["high_conv_bias_once"] = gap(F.conv2d(xd, kd, kbd).detach().cpu(), F.conv2d(x, k, kb))

torch_xla.backends.set_mat_mul_precision("highest")
before = tpu_numerics.count()
out["highest_vs_exact"] = gap((a.to(dev) @ b.to(dev)).cpu(), a @ b)
out["highest_counted"] = tpu_numerics.count() - before
before = tpu_numerics.count()
torch_xla.backends.set_mat_mul_precision("default")
out["cpu_vs_exact"] = gap(a @ b, a.double().matmul(b.double()).float())
out["cpu_counted"] = tpu_numerics.count() - before
print("NUMERICS" + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def numerics(probes) -> dict:
    return probe(probes["on"], "NUMERICS")


def test_default_rounds_matmul_linear_conv_inputs_to_bfloat16(numerics):
    assert numerics["active"]
    for op in ("mm", "linear", "conv"):
        assert numerics[f"{op}_vs_rounded"] < 1e-4, (op, numerics)
        assert numerics[f"{op}_vs_exact"] > 1e-2, (op, numerics)  # exact fp32 it is not


def test_gradients_are_rounded_too_but_not_the_bias_sum(numerics):
    assert numerics["dinput_vs_rounded"] < 1e-4 < numerics["dinput_vs_exact"], numerics
    assert numerics["dweight_vs_rounded"] < 1e-4, numerics
    assert numerics["dlinear_vs_rounded"] < 1e-4, numerics
    assert numerics["dbias_vs_exact"] < 1e-4, numerics
    assert numerics["count_default"] >= 6, numerics


def test_high_is_three_passes_between_default_and_exact(numerics):
    assert numerics["high_vs_3pass"] < 1e-5, numerics
    assert numerics["high_vs_exact"] < numerics["mm_vs_exact"] / 30, numerics
    assert numerics["high_dbias_vs_exact"] < 1e-4, numerics  # the bias gradient once, not 3x
    assert numerics["high_conv_bias_once"] < 1e-3, numerics


def test_highest_is_exact_and_cpu_tensors_are_untouched(numerics):
    assert numerics["highest_vs_exact"] < 1e-5 and numerics["highest_counted"] == 0, numerics
    assert numerics["cpu_vs_exact"] < 1e-5 and numerics["cpu_counted"] == 0, numerics


PROCESSES = """
import os, sys, json
import torch

def replica(index, folder):
    import torch_xla, tpu_numerics
    dev = torch_xla.device()
    (torch.randn(8, 8, device=dev) @ torch.randn(8, 8, device=dev)).cpu()
    open(os.path.join(folder, f"replica-{os.getpid()}"), "w").write(str(tpu_numerics.count()))

if __name__ == "__main__":
    import torch_xla
    folder = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    torch_xla.launch(replica, args=(folder,), start_method="fork")
    torch_xla.launch(replica, args=(folder,), start_method="spawn")
    pid = os.fork()
    if pid == 0:  # a plain forked child that leaves without atexit, like a pool worker
        replica(0, folder)
        os._exit(0)
    os.waitpid(pid, 0)
    print(json.dumps({"parent": os.getpid()}))
"""


def test_counter_in_forked_spawned_and_launched_replicas(tmp_path):
    sys.path.insert(0, str(LANE))
    from tpu_numerics import counts

    parent = last_json(emulated(PROCESSES, tmp_path))["parent"]
    replicas = {int(p.name.split("-")[1]): int(p.read_text())
                for p in tmp_path.glob("replica-*")}
    proof = counts(str(tmp_path / "proof"))
    assert len(replicas) == 3 and parent not in replicas, replicas
    assert all(n >= 1 for n in replicas.values()), replicas  # counted in each process
    assert all(proof.get(pid, 0) >= 1 for pid in replicas), (proof, replicas)  # and visible


#: One fresh Python per mode (lane on / off) answers three questions, each on its own line:
#: is another sitecustomize still chained, what tolerance the course picks, and does scan_layers
#: run; the lane-on one also runs NUMERICS (its own line) before scan_layers. Each test reads
#: its own line; a crash in scan_layers fails only the scan test.
PROBES = """
import builtins, json, sys, torch_xla
print("CHAINED" + json.dumps([getattr(builtins, 'CHAINED', False), 'tpu_numerics' in sys.modules]))
from course.precision import FP32_TOLERANCE, TPU_TOLERANCE, cpu_tolerance, runtime
print("TOLERANCE" + json.dumps([runtime(), cpu_tolerance()[0], TPU_TOLERANCE["default"],
                                FP32_TOLERANCE]), flush=True)
import os
if os.environ["TPU_NUMERICS"] == "1":
    import numerics  # noqa: F401  (NUMERICS, written beside this script)
import torch
from torch_xla.experimental.scan_layers import scan_layers
torch.manual_seed(0)
layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
x = torch.randn(4, 16)
ref = x
for layer in layers:
    ref = layer(ref)
dev = torch_xla.device()
y = scan_layers(layers.to(dev), x.to(dev)).cpu()
print("SCAN" + json.dumps({"gap": (y - ref).abs().max().item()}))
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """The PROBES script with the lane on and off, beside another sitecustomize; not checked
    here: each test checks the part it reads."""
    other = tmp_path_factory.mktemp("other")
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.CHAINED = True\n")
    procs = {}
    for name, on in (("on", True), ("off", False)):
        folder = tmp_path_factory.mktemp(name)
        (folder / "numerics.py").write_text(NUMERICS)
        procs[name] = emulated(PROBES, folder, on=on, extra_path=str(other), check=False)
    return procs


def probe(proc: subprocess.CompletedProcess[str], tag: str):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag)]
    assert lines, (f"no {tag} line (exit {proc.returncode})", proc.stdout[-3000:],
                   proc.stderr[-3000:])
    return json.loads(lines[-1][len(tag):])


def test_off_without_the_variable_and_another_sitecustomize_still_runs(probes):
    assert probe(probes["on"], "CHAINED") == [True, True]
    assert probe(probes["off"], "CHAINED") == [True, False]


def test_course_tolerance_treats_the_emulation_like_a_tpu(probes):
    name, tol, tpu, fp32 = probe(probes["on"], "TOLERANCE")
    assert (name, tol) == ("emulated TPU", tpu) and tpu > 100 * fp32
    name, tol, _, _ = probe(probes["off"], "TOLERANCE")
    assert (name, tol) == ("XLA:CPU", fp32)


#: One fresh Python per mode (lane off / on) under SPMD on 4 devices (SPMD is process-wide): the
#: recompile check first (its compile count is read before anything else compiles), then the
#: sharding check; each on its own line, read by its own test.
SPMD = """
import json, os
os.environ["CPU_NUM_DEVICES"] = "4"
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2)

xr.use_spmd()
dev, mesh = torch_xla.device(), xs.Mesh(np.arange(4), (4,), ("data",))
w = torch.randn(64, 10).to(dev)  # unannotated: replicated by torch_xla after the first run
for _ in range(3):
    x = torch.randn(128, 64).to(dev)
    xs.mark_sharding(x, mesh, ("data", None))
    out = x @ w
    xs.mark_sharding(out, mesh, ("data", None))
    torch_xla.sync()
print("RECOMPILE" + json.dumps({"compiles": met.metric_data("CompileTime")[0],
                                "w": torch_xla._XLAC._get_xla_sharding_spec(w)}), flush=True)

made = [torch.ones(3).to(dev), torch.zeros(3, device=dev), torch.nn.Linear(8, 16).to(dev).weight]
model = FSDPv2(torch.nn.Linear(8, 16).to(dev), mesh=xs.Mesh(np.arange(4), (4,), ("fsdp",)))
print("SHARDING" + json.dumps({"functional": [torch._is_functional_tensor(t) for t in made],
                               "fsdp_weight": torch_xla._XLAC._get_xla_sharding_spec(
                                   model.module.weight)}))
"""


@pytest.fixture(scope="module")
def spmd(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """The SPMD script with the lane off and on; each test checks the line it reads."""
    procs = {}
    for name, on in (("off", False), ("on", True)):
        procs[name] = emulated(SPMD, tmp_path_factory.mktemp(f"spmd_{name}"), on=on,
                               check=False)
    return procs


def test_tensors_made_under_the_lane_are_the_usual_ones_and_fsdpv2_shards_them(spmd):
    """The mode sees factory ops and CPU->XLA copies itself (no XLA input for functionalization
    to unwrap), with Functionalize excluded: torch_xla then returns unwrapped tensors, and
    ``param.data = ...`` (FSDPv2's ``module.to('xla')``) silently re-uploads them replicated."""
    off = probe(spmd["off"], "SHARDING")
    on = probe(spmd["on"], "SHARDING")
    assert off == {"functional": [True] * 3, "fsdp_weight": "{devices=[4,1]0,1,2,3}"}, off
    assert on == off


def test_the_rounding_adds_no_recompile_under_spmd(spmd):
    """After the first run torch_xla marks an unannotated input ``{replicated}``, and a cast of
    it inherits that annotation: rounding casts would make step 2's graph differ from step 1's
    (a second compile a TPU, which rounds inside the dot, does not have)."""
    off = probe(spmd["off"], "RECOMPILE")
    assert off == {"compiles": 1, "w": "{replicated}"}, off
    assert probe(spmd["on"], "RECOMPILE") == off


def test_scan_layers_runs_under_the_lane_and_its_layers_round(probes):
    """scan_layers traces its layer with AOTAutograd, which pops every dispatch mode for a
    while (preserve_rng_state) and traces on fake tensors of device xla. The lane's mode used
    to be freed while popped (a segfault) and asked fake tensors for their sharding."""
    for proc in probes.values():
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    on, off = probe(probes["on"], "SCAN"), probe(probes["off"], "SCAN")
    print(on, off)
    assert off["gap"] < 1e-5 < on["gap"] < 0.1  # exact on XLA:CPU, bf16-rounded under the lane
