"""tpu_helpers.pretrained: a Hub-shaped checkpoint (a transformers LlamaConfig model saved by
``save_pretrained``: sharded safetensors with an index; nothing downloaded) streamed onto the XLA
device one tensor at a time, against ``from_pretrained`` on the CPU; the errors a user meets;
and the loading benchmark's peak host memory (benchmarks/bench_loading.py), measured."""

from __future__ import annotations

import json
import struct

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch_xla  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tpu_helpers.pretrained import (  # noqa: E402
    CheckpointMismatch,
    checkpoint_files,
    generate_greedy,
    parameter_bytes,
    stream_to_device,
)


def saved(folder, tied=False, shard="100KB"):
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=shard)
    return config


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_weights_give_the_cpu_models_logits(tmp_path, tied):
    config = saved(tmp_path, tied)
    files = checkpoint_files(tmp_path)
    assert len(files) > 1 and all(name.endswith(".safetensors") for name in files)
    reference = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    device = torch_xla.device()
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    done = stream_to_device(model, tmp_path)
    print(done)
    assert done.tensors == sum(map(len, files.values())) and done.files == list(files)
    unique = {t.data_ptr(): t for t in reference.state_dict().values()}  # tied: once
    assert done.bytes == sum(t.nbytes for t in unique.values())
    if tied:  # lm_head is the embedding: one tensor, still shared
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.device.type == "xla" for p in model.parameters())
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (reference(tokens).logits - model(tokens.to(device)).logits.cpu()).abs().max()
    print(f"max |logits - cpu| = {gap:.2e}; device bytes {parameter_bytes(model)}")
    assert gap < 1e-4


def test_a_cast_on_the_host(tmp_path):
    config = saved(tmp_path)
    with torch.device(torch_xla.device()):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    stream_to_device(model, tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_mismatches_are_named_before_anything_is_copied(tmp_path):
    config = saved(tmp_path, shard="10MB")
    small = LlamaConfig(**{**config.to_dict(), "intermediate_size": 96})
    with torch.device(torch_xla.device()):
        other = LlamaForCausalLM(small)
    before = other.model.layers[0].mlp.up_proj.weight
    with pytest.raises(CheckpointMismatch, match=r"model.safetensors: 'model.layers.0.mlp.down_"
                                                 r"proj.weight' has shape \[64, 128\], the model's"
                                                 r" \[64, 96\]"):
        stream_to_device(other, tmp_path)
    assert other.model.layers[0].mlp.up_proj.weight is before  # nothing swapped
    with torch.device(torch_xla.device()):
        model = LlamaForCausalLM(config)
    model.register_buffer("extra", torch.zeros(2, device=torch_xla.device()))
    with pytest.raises(CheckpointMismatch, match=r"no tensor for \['extra'\]"):
        stream_to_device(model, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]" + b"\0" * 8)
    with pytest.raises(CheckpointMismatch, match="not a safetensors file"):
        stream_to_device(model, tmp_path)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor"):
        checkpoint_files(tmp_path / "nowhere")
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 128


# One line: it measures host memory of three processes; the 2.8 line's streaming and to_mesh (the
# private _XLAC call) are pinned by tests/test_finetune.py's both_lines tests and notebook 14.
@pytest.mark.one_line
def test_the_loading_benchmark_streams_within_the_largest_tensor(capsys):
    """Issue 39's loading goal, measured (quick size, each method in a fresh Python)."""
    from benchmarks import bench_loading, run_all

    rows = bench_loading.run(quick=True)
    with capsys.disabled():
        print("\n" + bench_loading.format_rows(rows))
    by = {r["key"]: r for r in rows}
    assert by["a"]["model_mib"] == by["b"]["model_mib"] == by["c"]["model_mib"] > 30
    met = dict(run_all.goals(rows))
    loading = {t: m for t, m in met.items() if t.startswith("loading (")}
    print(*loading, sep="\n")
    assert len(loading) == 3 and all(loading.values())  # (b), (c) within; (c) read once, 1/8
    assert by["c"]["read_mib"] == by["c"]["model_mib"]  # one process read it once for 8
    table = run_all.table_rows(rows)
    assert [t["benchmark"] for t in table] == ["loading"] * 3


@pytest.mark.parametrize("dtype,frozen", [(torch.float32, False), (torch.bfloat16, False),
                                          (torch.float32, True)])
def test_training_bytes_are_the_bytes_on_the_device_after_a_step(tmp_path, dtype, frozen):
    """The formula against the tensors a real AdamW step leaves on the XLA device: every
    weight, each trainable weight's gradient and its two AdamW states (LoRA's shape: a frozen
    base, a few trainable tensors)."""
    from tpu_helpers.pretrained import training_bytes

    config = saved(tmp_path)
    device = torch_xla.device()
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    stream_to_device(model, tmp_path, dtype=dtype)
    if frozen:  # the base frozen; the attention projections of layer 0 train
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("model.layers.0.self_attn.")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = torch.randint(0, 1000, (2, 16)).to(device)
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    torch_xla.sync()
    params = list(model.parameters())  # tied weights once
    trainable = [p for p in params if p.requires_grad]
    on_device = {
        "weights": sum(p.nbytes for p in params),
        "gradients": sum(p.grad.nbytes for p in trainable),
        "optimizer": sum(t.nbytes for state in optimizer.state.values()
                         for k, t in state.items() if k != "step"),  # step: a CPU scalar
    }
    formula = training_bytes(sum(p.numel() for p in params), sum(p.numel() for p in trainable),
                             bytes_per_weight=torch.finfo(dtype).bits // 8)
    print(dtype, "frozen base" if frozen else "full", on_device, formula)
    assert on_device == {"weights": formula.weights, "gradients": formula.gradients,
                         "optimizer": formula.optimizer}
    assert all(t.device.type == "xla" for state in optimizer.state.values()
               for k, t in state.items() if k != "step")
    assert training_bytes(10, 2, shards=4) == type(formula)(10, 2, 4)  # 40/4, 8/4, 16/4 bytes


def test_loading_is_measured_in_fresh_processes_once_the_runtime_started():
    """Notebook 14 forks its measuring children from the kernel (before the kernel uses its
    device: the notebook runs that path); a started runtime's threads would not survive a fork,
    so then ``measure_loading`` starts fresh Pythons (the benchmark's path, above)."""
    from course.finetune import can_fork

    (torch.ones(2, device=torch_xla.device()) * 2).cpu()
    assert not can_fork()


def test_greedy_generation_equals_generate_and_compiles_one_step_graph():
    from tpu_helpers.metrics import metric_count

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, eos_token_id=None)  # never stops early
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict())
    model.to(torch_xla.device())
    g = torch.Generator().manual_seed(2)
    prompts, lengths = torch.randint(0, 1000, (3, 12), generator=g), [12, 7, 3]
    expected = torch.stack([reference.generate(  # each prompt alone, unpadded, on the CPU
        prompts[i:i + 1, :n], attention_mask=torch.ones(1, n, dtype=torch.long),
        max_new_tokens=6, do_sample=False, pad_token_id=0)[0, n:] for i, n in enumerate(lengths)])
    torch_xla.sync()
    before = metric_count("CompileTime")
    got = generate_greedy(model, prompts, 6, lengths)  # rows 2 and 3 padded with other tokens
    first = metric_count("CompileTime") - before
    other = generate_greedy(model, torch.randint(0, 1000, (3, 12), generator=g), 6, [4, 12, 9])
    again = metric_count("CompileTime") - before - first
    start = metric_count("CompileTime")
    one = prompts[:1].to(torch_xla.device())
    model.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=6, do_sample=False,
                   pad_token_id=0)
    by_generate = metric_count("CompileTime") - start
    print(f"{got.tolist()} (compiles: {first}, then {again} for other prompts of the same width; "
          f"generate on the device: {by_generate} for one prompt)")
    assert torch.equal(got, expected) and other.shape == (3, 6)
    assert first == 1 and again == 0  # one step graph, reused by every step and prompt
    assert by_generate >= 6  # a longer input each token: a new graph each token
    start = metric_count("CompileTime")
    for bad in ({"new_tokens": 0}, {"lengths": [0, 7, 3]}, {"lengths": [13, 7, 3]},
                {"lengths": [12, 7]}, {"lengths": [12.0, 7.0, 3.0]},
                {"new_tokens": 53}):  # 12 + 53 positions: over max_position_embeddings
        with pytest.raises(ValueError, match="generate_greedy: need new_tokens >= 1"):
            generate_greedy(model, prompts, **{"new_tokens": 6, "lengths": lengths, **bad})
    with pytest.raises(ValueError, match="one integer length in 1..12 per row of 0"):
        generate_greedy(model, prompts[:0], 6)
    assert metric_count("CompileTime") == start  # refused on the host, before any graph
