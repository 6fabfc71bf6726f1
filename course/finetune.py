"""Notebook 14's demo pieces: a Hub-shaped checkpoint made here (nothing downloaded), loading
measured in processes of their own, text blocks for a causal LM, and what fits on a TPU for
real models.

The loading children read ``VmHWM`` (the process image's own high-water mark: ``ru_maxrss`` of a
child started from a big parent carries the parent's peak) above a baseline taken after
``import torch_xla, transformers`` and one op on the device. On XLA:CPU the "device" buffers are
host memory too, so each row also reports the bytes the device holds and the host peak beyond
them: what the method itself holds on the host.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
MIB, GB = 1 << 20, 10**9  # Cloud TPU's docs give HBM in GB
METHODS = {"a": "(a) from_pretrained on the CPU, then .to(device)",
           "b": "(b) built on the device, tensors streamed one at a time",
           "c": "(c) streamed onto the mesh, each device its FSDPv2 shard"}
#: HBM per chip: docs.cloud.google.com/tpu/docs/v5e and /v6e ("HBM capacity per chip").
HBM = {"v5e": 16 * GB, "v6e": 32 * GB}

#: config.json values of real models (architecture, fields, parameters the model card states);
#: sources: notebook 14, section 8. Counting is done by :func:`count_parameters`.
HUB_MODELS = {
    "Qwen/Qwen2.5-0.5B": ("qwen2", dict(hidden_size=896, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                          vocab_size=151936, tie_word_embeddings=True), 0.49e9),
    "meta-llama/Llama-3.2-1B": ("llama", dict(hidden_size=2048, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                intermediate_size=8192, vocab_size=128256,
                                tie_word_embeddings=True), 1.23e9),
    "google/gemma-2-2b": ("gemma2", dict(hidden_size=2304, num_hidden_layers=26,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                          intermediate_size=9216, vocab_size=256000,
                          tie_word_embeddings=True), 2.6e9),
    "Qwen/Qwen2.5-7B": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                        vocab_size=152064, tie_word_embeddings=False), 7.61e9),
    "meta-llama/Llama-3.1-8B": ("llama", dict(hidden_size=4096, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=14336, vocab_size=128256,
                                tie_word_embeddings=False), 8.0e9),
}


#: Llama-architecture sizes: "tiny" trains in the notebook; "quick" (48 MiB) and "full" (245 MiB)
#: are loaded by the measurements: many tensors, none a large share (as in a real LLM).
SIZES = {"tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2),
         "quick": dict(vocab_size=8000, hidden_size=384, intermediate_size=1024,
                       num_hidden_layers=4),
         "full": dict(vocab_size=8000, hidden_size=768, intermediate_size=2048,
                      num_hidden_layers=8)}


def save_hub_shaped(folder: str | Path, tokenizer=None, *, size: str = "tiny", seed: int = 0,
                    shard: str = "1MB") -> Path:
    """Save a Llama-architecture model (random weights, nothing downloaded) and its tokenizer
    as the Hub stores a big model: safetensors sharded into several files with
    ``model.safetensors.index.json`` (``save_pretrained``). "tiny" takes the tokenizer's vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {"vocab_size": len(tokenizer)} | SIZES[size] if tokenizer else SIZES[size]
    torch.manual_seed(seed)
    config = LlamaConfig(num_attention_heads=4 if size == "tiny" else 8, num_key_value_heads=2
                         if size == "tiny" else 4, tie_word_embeddings=False, **fields)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=shard)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return Path(folder)


def lm_blocks(tokenizer, texts: list[str], length: int) -> list[dict[str, torch.Tensor]]:
    """nanoGPT's batches for a causal LM: every text's tokens and an end-of-text token in one
    stream, cut into rows of ``length`` (no padding: every batch has one shape); labels are the
    tokens."""
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + end]
    rows = torch.tensor(stream[:len(stream) // length * length]).view(-1, length)
    return [{"input_ids": r, "labels": r} for r in rows]


def _measure(method: str, folder: str, devices: int) -> dict[str, Any]:
    """One way of loading, measured in this process (a child: forked or a fresh Python), on
    XLA:CPU whatever the parent runs on: its own devices, its own peak."""
    os.environ |= {"PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "2",
                   "CPU_NUM_DEVICES": str(devices if method == "c" else 1)}
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpu_helpers.pretrained import parameter_bytes, stream_to_device
    from tpu_helpers.spmd import device_mesh

    if method == "c":
        xr.use_spmd()  # one process for every device of the host
    device = torch_xla.device()
    (torch.ones(2, device=device) * 2).cpu()  # the runtime is up: part of the baseline
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # the model's code imported (transformers imports it lazily)
        AutoModelForCausalLM.from_config(config)
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now (Linux 4.0+): a forked child's peak is its own
    largest = read = 0
    if method == "a":
        model = AutoModelForCausalLM.from_pretrained(folder).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
        got = stream_to_device(model, folder, mesh=device_mesh(("fsdp",)) if method == "c"
                               else None)
        largest, read = got.largest_bytes, got.bytes
    torch_xla.sync()
    xm.wait_device_ops()
    peak = _status_kib("VmHWM")  # before the count below copies shards out
    held = held_bytes(model, buffers=True, sharded=method == "c")
    return {"base": base * 1024, "peak": peak * 1024, "model": parameter_bytes(model),
            "largest": largest, "read": read, "held": held}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _forked(method: str, folder: str, devices: int, conn) -> None:
    try:
        conn.send((0, _measure(method, folder, devices)))
    except BaseException:  # noqa: BLE001  (the parent raises it, with the child's traceback)
        conn.send((1, traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)  # no atexit handlers or runtime teardown of the parent's copies


def can_fork() -> bool:
    """Forking this process for a measurement is safe: Linux, and torch_xla's runtime not yet
    started here (a started PJRT client's threads do not survive a fork). The check is torch_xla's
    private ``_XLAC._xla_runtime_is_initialized`` (as its own ``runtime.use_spmd`` uses it)."""
    if not sys.platform.startswith("linux"):
        return False
    import torch_xla

    return not torch_xla._XLAC._xla_runtime_is_initialized()


def measure_loading(methods: str, folder: str | Path, devices: int = 8,
                    fork: bool | None = None) -> list[dict[str, Any]]:
    """Each way of loading (keys of ``METHODS``) in a process of its own on XLA:CPU, all at once
    (``c``: SPMD over ``devices`` virtual devices): peak host MiB above the baseline, MiB the
    devices hold, and the host's beyond them. ``fork``: children forked from this process (its
    imports shared: seconds, not a fresh ``import torch_xla`` each; default when
    :func:`can_fork`), else each a fresh Python (the benchmark's way)."""
    if fork is None:
        fork = can_fork()
    if fork:
        ctx, results = multiprocessing.get_context("fork"), {}
        pipes = {m: ctx.Pipe(duplex=False) for m in methods}
        procs = [ctx.Process(target=_forked, args=(m, str(folder), devices, pipes[m][1]))
                 for m in methods]
        for proc in procs:
            proc.start()
        for m, (recv, send) in pipes.items():
            send.close()
            code, got = recv.recv() if recv.poll(600) else (1, "no answer in 600 s")
            results[m] = (None, got, code) if code else (got, "", 0)
        for proc in procs:
            proc.join()
        return [_loading_row(m, *results[m]) for m in methods]
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "XLA_FLAGS") if k in os.environ}
    env |= {"PYTHONPATH": str(REPO), "TORCH_WARM_POOL": "0"}
    code = "import json, sys; from course.finetune import _measure; print('RESULT ' + " \
           "json.dumps(_measure(sys.argv[1], sys.argv[2], int(sys.argv[3]))))"
    procs = {m: subprocess.Popen([sys.executable, "-c", code, m, str(folder), str(devices)],
                                 cwd=REPO, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env) for m in methods}
    rows = []
    for m, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        got = json.loads(out.split("RESULT ")[-1]) if proc.returncode == 0 else None
        rows.append(_loading_row(m, got, err, proc.returncode))
    return rows


def _loading_row(method: str, r: dict | None, err: str, code: int) -> dict[str, Any]:
    if code != 0:
        raise RuntimeError(f"loading method {method} failed:\n{err[-3000:]}")
    added, device = (r["peak"] - r["base"]) / MIB, sum(r["held"]) / MIB
    return {"key": method, "method": METHODS[method], "peak_added_mib": round(added, 1),
            "device_mib": round(device, 1), "per_device_mib": round(max(r["held"]) / MIB, 2),
            "host_beyond_device_mib": round(added - device, 1), "model_mib": round(
                r["model"] / MIB, 1), "largest_tensor_mib": round(r["largest"] / MIB, 1),
            "read_mib": round(r["read"] / MIB, 1)}


def hub_config(name: str, layers: int | None = None):
    """The transformers config of a :data:`HUB_MODELS` entry (``layers``: fewer, to measure)."""
    from transformers import AutoConfig

    kind, fields, _ = HUB_MODELS[name]
    fields = fields | ({"num_hidden_layers": layers} if layers else {})
    return AutoConfig.for_model(kind, **fields)


def on_meta(config, dtype=torch.bfloat16):
    """The model of ``config`` on the meta device: shapes only, no bytes, built in milliseconds."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                attn_implementation="eager")


def count_parameters(config) -> int:
    """Parameters of ``config``'s model, each tensor once (tied weights once), built on meta."""
    return sum(p.numel() for p in on_meta(config).parameters())


def lora_parameters(config, rank: int = 16) -> int:
    """Trainable parameters of a LoRA adapter of ``rank`` on every linear layer (peft's
    ``target_modules="all-linear"``), counted by peft itself on the meta device."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(on_meta(config), LoraConfig(r=rank, target_modules="all-linear"))
    return model.get_nb_trainable_parameters()[0]


def activations_per_row(name: str, tokens: int, dtype=torch.bfloat16) -> tuple[int, int]:
    """Bytes autograd keeps for one row of ``tokens`` (``saved_activation_bytes`` on the meta
    device, 1 and 2 layers: the layers are equal, so the rest is linear): without and with
    activation checkpointing (each layer keeps its input; one layer's own saved at a time)."""
    from tpu_helpers.pretrained import saved_activation_bytes

    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    one, two = (saved_activation_bytes(on_meta(hub_config(name, n), dtype), input_ids=ids,
                                       labels=ids) for n in (1, 2))
    config = hub_config(name)
    per_layer, rest, layers = two - one, 2 * one - two, config.num_hidden_layers
    layer_input = tokens * config.hidden_size * torch.empty((), dtype=dtype).element_size()
    return rest + layers * per_layer, rest + layers * layer_input + per_layer


def fits_table(names=tuple(HUB_MODELS), tokens: int = 2048, rank: int = 16, chips: int = 8):
    """Per chip, for each model: weights, gradients, optimizer state (``training_bytes``) and
    activations for one row of ``tokens`` per chip, under 4 ways of training; GB (10^9 bytes)."""
    import pandas as pd

    from tpu_helpers.pretrained import training_bytes

    rows = []
    for name in names:
        config = hub_config(name)
        params, adapter = count_parameters(config), lora_parameters(config, rank)
        plain, checkpointed = activations_per_row(name, tokens)
        setups = {"full, float32, AdamW": (training_bytes(params), 1),
                  "full, bfloat16, AdamW": (training_bytes(params, bytes_per_weight=2), 1),
                  f"LoRA r={rank}, bfloat16 base": (
                      _plus(training_bytes(params, 0, bytes_per_weight=2),
                            training_bytes(adapter, bytes_per_weight=4)), 1),
                  f"full, bfloat16, FSDPv2 over {chips}": (
                      training_bytes(params, bytes_per_weight=2, shards=chips), chips)}
        for setup, (held, n) in setups.items():
            rows.append({"model": name, "params (B)": round(params / 1e9, 2), "setup": setup,
                         "chips": n, "weights": held.weights / GB,
                         "grads + optimizer": (held.gradients + held.optimizer) / GB,
                         "activations": plain / GB, "activations, checkpointed": checkpointed / GB})
    table = pd.DataFrame(rows)
    table["per chip, checkpointed"] = (table["weights"] + table["grads + optimizer"]
                                       + table["activations, checkpointed"])
    for chip, hbm in HBM.items():
        table[f"fits {chip} ({hbm // GB} GB)"] = table["per chip, checkpointed"] <= hbm / GB
    return table.round(2)


def _plus(a, b):
    return type(a)(a.weights + b.weights, a.gradients + b.gradients, a.optimizer + b.optimizer)


def optimization_barriers(model) -> int:
    """Optimization barriers in the graph of ``model``'s gradients (nothing runs): call it after
    ``backward()``, before the step; 0 without torch_xla's activation checkpointing."""
    from tpu_helpers.metrics import hlo_text

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return hlo_text(grads).count("opt-barrier")


def held_bytes(model, buffers: bool = False, sharded: bool = True) -> list[int]:
    """Bytes of ``model``'s parameters (and ``buffers``) each device holds: read from their
    shards under SPMD (``sharded``), else all on the one device."""
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    held = [0] * xr.global_runtime_device_count()
    for t in [*model.parameters(), *(model.buffers() if buffers else ())]:
        if not sharded:
            held[0] += t.nbytes
            continue
        for shard in xs.XLAShardedTensor(t).local_shards:
            held[int(shard.shard_device.split(":")[-1])] += shard.data.nbytes
    return held


def write_run(out: str | Path, model, losses, compiled: list[int], barriers: int) -> None:
    """Notebook 14's script's results as JSON: loss and compiles per step (``compiled``: the
    compile count before each step, then at the end), ``barriers``, the bytes of weights each
    device holds, all weights' bytes and the trainable parameters."""
    params = list(model.parameters())
    Path(out).write_text(json.dumps({
        "losses": [round(x.item(), 4) for x in losses],
        "compiles": [b - a for a, b in zip(compiled, compiled[1:], strict=False)],
        "barriers": barriers, "held": held_bytes(model), "weights": sum(p.nbytes for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad)}))


def plot_fits(table, name: str, title: str):
    """``name``'s rows of :func:`fits_table` as stacked bars of GB per chip, each chip's HBM a
    line; returns those rows indexed by setup (show the figure with ``plt.show()``)."""
    rows = table[table["model"] == name].set_index("setup")
    ax = rows[["weights", "grads + optimizer", "activations, checkpointed"]].plot.barh(
        stacked=True, figsize=(7, 2.6))
    for (chip, hbm), style in zip(HBM.items(), ("--", ":"), strict=True):
        ax.axvline(hbm / GB, color="k", ls=style, label=f"{chip}: {hbm // GB} GB")
    ax.set(title=title, xlabel="GB per chip (expected, not yet run on a TPU)")
    ax.legend(loc="lower right")
    return rows
