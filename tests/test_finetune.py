"""Notebook 14's claims, checked with real libraries: tensors sent straight to their FSDPv2 shards
(``to_mesh``; even and uneven rows, a 2-axis mesh) equal the tensor and split it as
``mark_sharding`` does; LoRA (peft) on an FSDPv2-sharded base gives the same first gradients with
torch_xla's activation checkpointing as without (with ``use_cache=False``; with the cache on,
wrong on one device), and its graph holds optimization barriers;
``saved_activation_bytes`` on the meta device equals the CPU's count and is within 5% above
the XLA device's; a LoRA adapter
saved from the device (``save_adapter``) reloads on the CPU with the same logits; the real-model
parameter counts of the fits table are the model cards' within 1.5%."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
import torch_xla  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

SPMD = r"""
import json, os, sys
import numpy as np, torch, torch_xla
import torch_xla.runtime as xr
xr.use_spmd()
import torch_xla.distributed.spmd as xs
from tpu_helpers.pretrained import to_mesh

out = {}
for shape in [(16, 3), (10, 3), (5,), (), (3, 4, 2)]:
    for axes, mesh_shape in [(("fsdp",), (8,)), (("fsdp", "model"), (4, 2))]:
        mesh = xs.Mesh(np.arange(8), mesh_shape, axes)
        host = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
        ours = to_mesh(host, mesh)
        theirs = host.to(torch_xla.device())
        spec = ("fsdp",) + (None,) * (host.dim() - 1) if host.dim() else ()
        xs.mark_sharding(theirs, mesh, spec)
        out[f"{shape}-{mesh_shape}"] = {
            "equal": bool(torch.equal(ours.cpu(), host)),
            "spec": [xs.XLAShardedTensor(ours).sharding_spec,
                     xs.XLAShardedTensor(theirs).sharding_spec],
            "shards": [list(s.data.shape) for s in xs.XLAShardedTensor(ours).local_shards],
            "their_shards": [list(s.data.shape) for s in xs.XLAShardedTensor(theirs).local_shards]}
print("RESULT " + json.dumps(out))
"""

GRADS = r"""
import json, sys, warnings
import torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
xr.use_spmd()
import torch_xla.distributed.spmd as xs
from peft import LoraConfig, get_peft_model
from torch_xla.distributed.fsdp import checkpoint_module
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2)
from transformers import AutoConfig, AutoModelForCausalLM
from tpu_helpers.pretrained import stream_to_device
from tpu_helpers.spmd import device_mesh

warnings.filterwarnings("ignore")
folder, mesh = sys.argv[1], device_mesh(("fsdp",))
ids = torch.randint(0, 200, (8, 32), generator=torch.Generator().manual_seed(0))
out = {}
for mode in ("plain", "checkpointed"):
    torch.manual_seed(0)  # the same LoRA A matrices (B starts at zero), drawn on the device:
    xm.set_rng_state(0)   # the XLA generator too
    with torch.device(torch_xla.device()):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    stream_to_device(model, folder, mesh=mesh)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    if mode != "plain":
        model.config.use_cache = False
        model.enable_input_require_grads()
        layers = model.base_model.model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_module(layer)
    model = FSDPv2(model, mesh=mesh, shard_output=lambda o, m: xs.mark_sharding(
        o.logits, m, ("fsdp", None, None)))
    batch = ids.to(torch_xla.device())
    xs.mark_sharding(batch, mesh, ("fsdp", None))
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([g for _, g in named])
    torch_xla.sync()  # one graph for the loss and every gradient (a .cpu() each would compile each)
    out[mode] = {"loss": loss.item(), "barriers": hlo.count("opt-barrier"),
                 "grads": {n: g.cpu().tolist() for n, g in named}}
print("RESULT " + json.dumps(out))
"""


def run_spmd(code: str, *args: str, devices: int = 8) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ")[-1])


def tiny_checkpoint(folder: Path, vocab: int = 200) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=136,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100KB")
    return folder


@pytest.mark.both_lines  # torch_xla's private _global_tensor_from_cpu_shards: both lines
def test_to_mesh_sends_each_device_its_rows_as_mark_sharding_splits_them():
    out = run_spmd(SPMD)
    for case, r in out.items():
        assert r["equal"], case
        assert r["spec"][0] == r["spec"][1], case  # the same annotation as mark_sharding's
        assert r["shards"] == r["their_shards"], case  # the same (padded) shard per device
    assert out["(10, 3)-(8,)"]["shards"][0] == [2, 3]  # 10 rows over 8: 2 each, padded


def test_lora_on_fsdp_v2_checkpointing_keeps_the_gradients_and_adds_barriers(tmp_path):
    """torch_xla's checkpoint_module on transformers 5.24's decoder layers under FSDPv2 (4
    virtual devices, the notebook's script's layout), cache off: the same gradients."""
    out = run_spmd(GRADS, str(tiny_checkpoint(tmp_path)), devices=4)
    plain, checkpointed = out["plain"], out["checkpointed"]
    assert plain["barriers"] == 0 < checkpointed["barriers"]
    assert abs(plain["loss"] - checkpointed["loss"]) < 1e-6
    assert plain["grads"].keys() == checkpointed["grads"].keys() and len(plain["grads"]) > 0
    assert all("lora_" in name for name in plain["grads"])  # the frozen base gets none
    for name, grad in plain["grads"].items():
        assert torch.allclose(torch.tensor(grad), torch.tensor(checkpointed["grads"][name]),
                              rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_checkpointing_with_the_cache_on_gives_wrong_gradients_or_fails(attention):
    """One device: with use_cache=True (the config's default) every recomputation appends its
    keys to the cache again: sdpa's gradients come out wrong with no error, eager raises."""
    from torch_xla.distributed.fsdp import checkpoint_module
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=136,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation=attention)
    ids = torch.randint(0, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode, cache in (("plain", True), ("checkpointed", False), ("cache on", True)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch_xla.device())
        if mode != "plain":
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = checkpoint_module(layer)
        batch = ids.to(torch_xla.device())
        try:
            model(input_ids=batch, labels=batch, use_cache=cache).loss.backward()
            grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
        except RuntimeError as err:
            grads[mode] = str(err)
    assert torch.allclose(grads["checkpointed"], grads["plain"], atol=1e-6)
    if attention == "eager":
        assert isinstance(grads["cache on"], str)  # a RuntimeError on the shapes
        assert any(m in grads["cache on"] for m in ("not compatible for broadcasting",  # 2.9
                                                    "dim1 == dim2"))  # 2.8's check
    else:
        assert (grads["cache on"] - grads["plain"]).abs().max() > 1e-3


def test_saved_activation_bytes_on_meta_equal_the_cpus_and_near_the_xla_devices():
    """Exactly the CPU's count; the XLA device's tensors (functionalized views) count 4% fewer
    here: the meta figure is the larger, an upper bound for the fits table."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpu_helpers.pretrained import saved_activation_bytes

    config = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=136,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="eager")
    counts = {}
    for device in ("meta", "cpu", torch_xla.device()):
        with torch.device(device):
            model = LlamaForCausalLM(config)
        ids = torch.zeros(2, 32, dtype=torch.long, device=device)
        counts[str(device)] = saved_activation_bytes(model, input_ids=ids, labels=ids)
    print(counts)
    assert counts["meta"] == counts["cpu"] > 0
    assert 0.95 * counts["meta"] <= counts["xla:0"] <= counts["meta"]


def test_an_adapter_saved_from_the_device_reloads_on_the_cpu(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpu_helpers.pretrained import save_adapter, stream_to_device

    folder, device = tiny_checkpoint(tmp_path / "base"), torch_xla.device()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    stream_to_device(model, folder)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    lora(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()
    optimizer.step()
    torch_xla.sync()
    with pytest.raises(RuntimeError, match="invalid python storage"):
        lora.save_pretrained(tmp_path / "direct")  # safetensors cannot read an XLA storage
    written = save_adapter(lora, tmp_path / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= written.keys()
    lora.eval()
    with torch.no_grad():
        on_device = lora(input_ids=ids.to(device)).logits.cpu()
        again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder),
                                          tmp_path / "adapter")
        on_cpu = again(input_ids=ids).logits
    assert torch.allclose(on_device, on_cpu, atol=1e-5), (on_device - on_cpu).abs().max()


def test_fits_table_counts_parameters_as_the_model_cards_state():
    from course.finetune import HUB_MODELS, activations_per_row, count_parameters, hub_config

    for name, (_, _, stated) in HUB_MODELS.items():
        counted = count_parameters(hub_config(name))
        assert abs(counted / stated - 1) < 0.015, (name, counted, stated)
    plain, checkpointed = activations_per_row("Qwen/Qwen2.5-0.5B", 256)
    assert 0 < checkpointed < plain
