"""course.text's TinyGPT hooks (notebook 10) and the checkpointing claim notebook 10 makes:
PyTorch's own ``torch.utils.checkpoint`` fails on the XLA device, torch_xla's works and
gives the same gradients. Real torch_xla on XLA:CPU, one device.

Flash attention's shape rule (``course.text.flash_attention_problem``, notebook 10): its
constants against the installed torch_xla, its closed form, its refusals, what the kernel does
off a TPU, and, where jax is importable (the jax lane), the rule against jax's own kernel code,
traced with torch_xla's block sizes (tracing needs no TPU)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
import torch_xla
from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

from course.text import (
    FLASH_BLOCKS,
    FLASH_MIN_BLOCK,
    FlashShapeError,
    TinyGPT,
    causal_attention,
    check_flash_attention_shape,
    count_collectives,
    flash_attention_problem,
    fsdp_step_collectives,
)


def _model(cls=TinyGPT, **kwargs):
    torch.manual_seed(0)
    return cls(16, 2, 2, max_len=8, **kwargs)


def _grads(model, device):
    model = model.to(device)
    tokens = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:]).backward()
    torch_xla.sync()
    return torch.cat([p.grad.cpu().flatten() for p in model.parameters()])


def test_attend_and_layers_hooks_keep_the_default_model():
    tokens = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    calls = []

    def counting(q, k, v):
        calls.append(q.shape)
        return causal_attention(q, k, v)

    class Doubled(TinyGPT):
        def layers(self, x):
            return self.blocks(self.blocks(x))

    with torch.no_grad():
        plain, hooked = _model()(tokens), _model(attend=counting)(tokens)
        doubled = _model(Doubled)(tokens)
    assert torch.equal(plain, hooked) and len(calls) == 2
    assert not torch.allclose(plain, doubled)


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_fails_on_xla(reentrant):
    class TorchCheckpointed(TinyGPT):
        def layers(self, x):
            for block in self.blocks:
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            return x

    with pytest.raises(AttributeError, match="has no attribute 'xla'"):
        _grads(_model(TorchCheckpointed), torch_xla.device())


def test_torch_xla_checkpoint_gives_the_same_gradients():
    class Checkpointed(TinyGPT):
        def layers(self, x):
            for block in self.blocks:
                x = xla_checkpoint(block, x)
            return x

    device = torch_xla.device()
    plain, remat = _grads(_model(), device), _grads(_model(Checkpointed), device)
    assert (plain - remat).abs().max() < 1e-5


def test_flash_rule_uses_the_installed_torch_xla_block_sizes():
    from torch_xla.experimental.custom_kernel import FlashAttention

    assert FlashAttention.DEFAULT_BLOCK_SIZES == FLASH_BLOCKS
    assert FlashAttention.MIN_BLOCK_SIZE == FLASH_MIN_BLOCK == FlashAttention.NUM_LANES


def test_flash_rule_closed_form():
    """The block-by-block rule is the sentence FLASH_RULE states: to train, L is 128, 256, 512
    or a multiple of 1024; without backward any L."""
    trainable = [n for n in range(1, 4200) if flash_attention_problem((2, 2, n, 16)) is None]
    assert trainable == [128, 256, 512, 1024, 2048, 3072, 4096]
    assert all(flash_attention_problem((2, 2, n, 16), backward=False) is None
               for n in range(1, 4200))


@pytest.mark.parametrize("shape", [(8, 4, 63, 16), (8, 4, 127, 16), (8, 4, 63, 8),
                                   (8, 4, 384, 16), (8, 4, 640, 16), (8, 4, 1536, 16)])
def test_flash_refuses_what_it_cannot_train_on_naming_shape_and_rule(shape):
    """Notebook 10's own lengths (63/127 tokens, head dim 16, or 8 with CI's settings) and
    lengths where a backward block does not divide L."""
    with pytest.raises(FlashShapeError) as err:
        check_flash_attention_shape(shape, batch_shards=4)
    message = str(err.value)
    assert str(shape) in message and "128, 256, 512 or a multiple of 1024" in message
    check_flash_attention_shape(shape, backward=False, batch_shards=4)  # forward only: fine


@pytest.mark.parametrize(("shape", "backward", "shards"), [
    ((4, 2, 128, 8), True, 1),    # upstream's test_flash_attention_backward (test_pallas.py)
    ((8, 2, 128, 8), True, 4),    # its SPMD data-parallel backward test (test_pallas_spmd.py)
    ((1, 2, 513, 4), False, 1),   # its kv-padding forward test
    ((8, 4, 256, 16), True, 4), ((2, 2, 2048, 128), True, 2),
])
def test_flash_takes_the_shapes_upstream_tests(shape, backward, shards):
    check_flash_attention_shape(shape, backward=backward, batch_shards=shards)


@pytest.mark.parametrize(("shape", "words"), [
    ((8, 4, 1024, 192), "head_dim 192"), ((6, 4, 128, 16), "batch 6"),
    ((4, 128, 16), "not [batch, heads, L, head_dim]")])
def test_flash_refuses_other_shapes(shape, words):
    assert words in flash_attention_problem(shape, batch_shards=4)


def test_flash_attention_off_a_tpu_fails_inside_the_kernel():
    """Off a TPU the kernel cannot run: without jax it fails importing jax, with jax (the jax
    lane) jax refuses to lower a Pallas TPU kernel for the CPU. Notebook 10 refuses earlier."""
    from torch_xla.experimental.custom_kernel import flash_attention

    q = torch.randn(2, 2, 128, 8).to(torch_xla.device())
    expected = ((ValueError, "Only interpret mode is supported on CPU backend")
                if importlib.util.find_spec("jax") else
                (ModuleNotFoundError, "No module named 'jax'"))
    with pytest.raises(expected[0], match=expected[1]):
        flash_attention(q, q, q, causal=True)
        torch_xla.sync()


def _trace_jax_kernels(shape, backward):
    """Trace jax's flash-attention functions as torch_xla 2.8/2.9 call them (their blocks;
    k/v padded to a multiple of min(512, L) in the forward); raise what jax raises."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b, h, n, d = shape
    blk = {k: min(v, n) for k, v in FLASH_BLOCKS.items()}
    blk["block_b"] = min(FLASH_BLOCKS["block_b"], b)
    sds = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    padded = -(-n // blk["block_k"]) * blk["block_k"]
    fwd = functools.partial(fa._flash_attention_impl, ab=None, segment_ids=None,
                            save_residuals=backward, causal=True, sm_scale=0.5,
                            block_b=blk["block_b"], block_q=blk["block_q"],
                            block_k_major=blk["block_k_major"], block_k=blk["block_k"],
                            debug=False)
    jax.eval_shape(fwd, sds((b, h, n, d)), sds((b, h, padded, d)), sds((b, h, padded, d)))
    if not backward:
        return
    common = dict(ab=None, segment_ids=None, sm_scale=0.5, causal=True,
                  mask_value=fa.DEFAULT_MASK_VALUE, debug=False)
    dq = functools.partial(fa._flash_attention_bwd_dq, block_q_major=blk["block_q_dq"],
                           block_k_major=blk["block_k_major_dq"], block_k=blk["block_k_dq"],
                           **common)
    dkv = functools.partial(fa._flash_attention_bwd_dkv, block_q_major=blk["block_q_major_dkv"],
                            block_q=blk["block_q_dkv"], block_k_major=blk["block_k_major_dkv"],
                            block_k=blk["block_k_dkv"], **common)
    qkv, lm = sds((b, h, n, d)), sds((b, h, n))
    for kernel in (dq, dkv):
        jax.eval_shape(lambda q, k, v, lse, mx, do, di, f=kernel:
                       f(q, k, v, l=lse, m=mx, do=do, di=di), qkv, qkv, qkv, lm, lm, qkv, lm)


@pytest.mark.parametrize("length", [63, 64, 127, 128, 129, 255, 256, 384, 511, 512, 513, 640,
                                    1024, 1536, 2048])
@pytest.mark.parametrize("head_dim", [16, 192])
def test_flash_rule_matches_jax_kernel_code(length, head_dim):
    """With jax importable (the jax lane): jax's own kernel code, traced, fails exactly where
    the rule says (its _verify_block checks and the kernels' block shapes)."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.flash_attention")
    for backward in (False, True):
        shape = (4, 2, length, head_dim)
        problem = flash_attention_problem(shape, backward=backward)
        try:
            _trace_jax_kernels(shape, backward)
        except (ValueError, TypeError, NotImplementedError) as err:
            assert problem, f"{shape} backward={backward}: jax fails ({err}), the rule does not"
        else:
            assert problem is None, f"{shape} backward={backward}: rule refuses, jax traces"


def test_count_collectives_reads_hlo_text():
    hlo = """
  %all-gather.1 = f32[256,32]{1,0} all-gather(f32[64,32]{1,0} %p0), dimensions={0}
  %all-reduce.2 = f32[] all-reduce(f32[] %x), to_apply=%sum
  %all-gather-start.3 = (f32[8]{0}, f32[32]{0}) all-gather-start(f32[8]{0} %p1)
  %all-gather-done.3 = f32[32]{0} all-gather-done((f32[8]{0}, f32[32]{0}) %all-gather-start.3)
  %fusion.4 = f32[8]{0} fusion(f32[32]{0} %all-gather-done.3), calls=%all-reduce-like
"""
    assert count_collectives(hlo) == {"all-gather": 2, "reduce-scatter": 0, "all-reduce": 1,
                                      "all-to-all": 0, "collective-permute": 0}


def test_fsdpv2_step_compiles_collectives():
    """Notebook 10's claim: the compiled FSDPv2 step (4 virtual devices) gathers with
    all-gather and sums gradients with all-reduce; XLA:CPU's partitioner picks no
    reduce-scatter for this tiny model (the notebook says so)."""
    found = fsdp_step_collectives(32, 1, 4, 64, 8)
    assert found["all-gather"] > 0 and found["all-reduce"] > 0
    assert found["reduce-scatter"] == 0


def test_xla_use_bf16_stores_float32_as_bfloat16_and_says_it_is_deprecated():
    """Notebook 09: XLA_USE_BF16=1 still works in 2.8/2.9 (csrc/dtype.cpp): a float32 tensor
    keeps reporting float32 but holds bfloat16 values, and a notice is printed."""
    code = ("import torch, torch_xla\n"
            "t = torch.tensor([1.0 + 2 ** -10], dtype=torch.float32).to(torch_xla.device())\n"
            "print('RESULT', t.dtype, repr((t * 1).cpu().item()))\n")
    env = dict(os.environ, XLA_USE_BF16="1", PJRT_DEVICE="CPU")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT torch.float32 1.0" in done.stdout  # 1 + 2^-10 rounds to 1.0 in bfloat16
    assert "XLA_USE_BF16 will be deprecated" in done.stdout


def test_torch_autocast_xla_accepts_float16():
    """Notebook 09: torch.autocast("xla") takes float16 (only torch_xla.amp.autocast refuses
    it, and only on a TPU)."""
    a = torch.ones(4, 4, device=torch_xla.device())
    with torch.autocast("xla", dtype=torch.float16):
        assert (a @ a).dtype == torch.float16
