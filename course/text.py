"""Text for notebooks 09 and 10: Tiny Shakespeare as one sample per speech, a byte-level
tokenizer, and the tiny decoder-only language model (course code, not toolkit).

The tokenizer is the simplest that needs nothing downloaded: a token is one UTF-8 byte
(vocabulary 256). Token 0 (NUL, absent from the text) pads. Every speech is checked on the
host: bytes that are not UTF-8 are a :class:`TextError` naming the speech's index.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from course.datasets import data_dir

VOCAB_SIZE = 256
PAD_ID = 0


class TextError(ValueError):
    """A sample that cannot be tokenized, named by its index."""


def split_speeches(raw: bytes) -> list[bytes]:
    """One sample per speech: the blocks between blank lines (speaker line included)."""
    return [block.strip(b"\n") for block in raw.split(b"\n\n") if block.strip(b"\n")]


def encode(samples: list[bytes]) -> list[np.ndarray]:
    """Byte tokens (int64) per sample; a sample that is not valid UTF-8 text, or holds the
    padding byte 0, is a TextError naming its index."""
    out = []
    for i, sample in enumerate(samples):
        try:
            sample.decode("utf-8")
        except UnicodeDecodeError as err:
            raise TextError(f"sample {i}: byte {err.start} ({sample[err.start]:#04x}) is not "
                            f"UTF-8 text ({err.reason}).") from None
        tokens = np.frombuffer(sample, dtype=np.uint8).astype(np.int64)
        if (tokens == PAD_ID).any():
            raise TextError(f"sample {i}: holds byte 0, the padding token.")
        out.append(tokens)
    return out


def decode(tokens) -> str:
    """Text from byte tokens (padding dropped); invalid UTF-8 shows as U+FFFD."""
    arr = np.asarray(tokens, dtype=np.int64)
    return bytes(arr[arr != PAD_ID].astype(np.uint8).tolist()).decode("utf-8", "replace")


def load_speeches(max_tokens: int, path: str | Path | None = None) -> list[np.ndarray]:
    """Tiny Shakespeare's speeches as byte tokens, those of at most ``max_tokens`` bytes."""
    path = Path(path) if path else data_dir() / "tinyshakespeare" / "input.txt"
    tokens = encode(split_speeches(path.read_bytes()))
    return [t for t in tokens if len(t) <= max_tokens]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over ``[B, heads, L, head_dim]``: each token sees itself and
    the tokens before it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP. Padding sits after
    the real tokens, so causal attention never lets a real token see it. ``attend`` computes
    the attention (notebook 10 passes a flash-attention kernel on a TPU)."""

    def __init__(self, d: int, heads: int, attend=causal_attention) -> None:
        super().__init__()
        self.heads, self.attend = heads, attend
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        att = self.attend(q, k, v)
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A decoder-only byte language model (nanoGPT's shape, tiny): logits ``[B, L, 256]``."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, max_len: int = 256,
                 attend=causal_attention):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB_SIZE, d), nn.Embedding(max_len, d)
        self.blocks = nn.Sequential(*(Block(d, heads, attend) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB_SIZE, bias=False)
        nn.init.normal_(self.head.weight, std=1 / math.sqrt(d))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln(self.layers(x)))

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks, one after the other (notebook 10 overrides this: scan, checkpointing)."""
        return self.blocks(x)


# ------------------------------------------------------------------ flash attention's shapes
# Notebook 10 can use torch_xla's Pallas flash-attention kernel (opt-in, a TPU with jax only).
# torch_xla 2.8/2.9 call jax's kernel functions with their own block sizes and skip jax's
# public shape checks ("Then we lose all the shape checks", custom_kernel.py v2.8.0 l.356,
# v2.9.0 l.357), so a shape the kernel cannot take fails deep inside jax, if at all. These
# functions check a shape first and name the rule. Read from source:
#   torch_xla/experimental/custom_kernel.py (pytorch/xla): FlashAttention.MIN_BLOCK_SIZE and
#     DEFAULT_BLOCK_SIZES at v2.8.0 l.752-768, v2.9.0 l.753-769; the forward takes
#     min(block, L) per block and pads k/v to a multiple of min(512, L) (v2.8.0 l.330-335 and
#     l.369-372, v2.9.0 l.331-336 and l.370-373); the backward takes min(block, L) for the dq
#     blocks (v2.8.0 l.557-562, v2.9.0 l.558-563) and the dkv blocks (v2.8.0 l.605-614,
#     v2.9.0 l.606-615) and pads nothing.
#   jax 0.7.2 jax/experimental/pallas/ops/tpu/flash_attention.py: _verify_block (l.1707-1715:
#     a block must not exceed its dimension and must divide it) called by the forward
#     (l.606-609; block_q need not divide), the dkv backward (l.963-966) and the dq backward
#     (l.1308-1310); the backward kernels repeat [rows, 128] statistics block_k // 128 times
#     (l.895-911, l.1228-1243), so their kv blocks must be multiples of 128; the forward's
#     multi-block kernel (L > 512) needs head_dim below 128 or a multiple of 128 (l.455-463).
# tests/test_text_model.py checks the constants against the installed torch_xla and, with jax
# importable, the rule against jax's own kernel code (traced, no TPU needed).

#: torch_xla's ``FlashAttention.DEFAULT_BLOCK_SIZES`` (v2.8.0 and v2.9.0, the same values).
FLASH_BLOCKS = {"block_q": 512, "block_k_major": 512, "block_k": 512, "block_b": 2,
                "block_q_major_dkv": 512, "block_k_major_dkv": 512, "block_q_dkv": 512,
                "block_k_dkv": 512, "block_q_dq": 1024, "block_k_dq": 256,
                "block_k_major_dq": 512}
#: torch_xla's ``FlashAttention.MIN_BLOCK_SIZE`` (jax's ``MIN_BLOCK_SIZE``, ``NUM_LANES``).
FLASH_MIN_BLOCK = 128
#: The rule in one sentence, as the refusal states it.
FLASH_RULE = ("torch_xla 2.8/2.9's flash_attention (jax's Pallas TPU kernel) takes q, k, v of "
              "one shape [batch, heads, L, head_dim]; to train (backward) L must be 128, 256, "
              "512 or a multiple of 1024; without backward any L; head_dim below 128 or a "
              "multiple of 128 when L > 512; batch divisible by the mesh axis it is split over")
#: The backward's blocks over the sequence and whether each is a kv block (a multiple of 128).
_BACKWARD_BLOCKS = (("block_q_dq", False), ("block_k_major_dq", False), ("block_k_dq", True),
                    ("block_q_major_dkv", False), ("block_q_dkv", False),
                    ("block_k_major_dkv", False), ("block_k_dkv", True))


class FlashShapeError(ValueError):
    """A q/k/v shape the flash-attention kernel cannot take; the message names the rule."""


def flash_attention_problem(shape, *, backward: bool = True, batch_shards: int = 1) -> str | None:
    """Why torch_xla's flash attention cannot take q/k/v of ``shape`` ([batch, heads, L,
    head_dim], split over ``batch_shards`` devices along batch), or None if it can. Pure:
    shapes and integers in, a sentence out (the sources are listed above)."""
    shape = tuple(int(n) for n in shape)
    if len(shape) != 4:
        return f"shape {shape} is not [batch, heads, L, head_dim]"
    batch, _, length, head_dim = shape
    if batch % batch_shards:
        return f"batch {batch} does not split evenly over {batch_shards} devices"
    if length > FLASH_BLOCKS["block_k"] and head_dim >= FLASH_MIN_BLOCK and (
            head_dim % FLASH_MIN_BLOCK):
        return (f"head_dim {head_dim} is neither below {FLASH_MIN_BLOCK} nor a multiple of it "
                f"(the forward's multi-block kernel, L {length} > {FLASH_BLOCKS['block_k']})")
    if not backward:
        return None
    for name, is_kv_block in _BACKWARD_BLOCKS:
        block = min(FLASH_BLOCKS[name], length)
        if length % block:
            return (f"the backward's {name} = min({FLASH_BLOCKS[name]}, L) = {block} does not "
                    f"divide L {length}")
        if is_kv_block and block % FLASH_MIN_BLOCK:
            return (f"the backward's kv block {name} = min({FLASH_BLOCKS[name]}, L) = {block} is "
                    f"not a multiple of {FLASH_MIN_BLOCK}")
    return None


def check_flash_attention_shape(shape, *, backward: bool = True, batch_shards: int = 1) -> None:
    """Raise :class:`FlashShapeError` naming the shape, the failing block and the rule if
    flash attention cannot take ``shape``; return None if it can."""
    problem = flash_attention_problem(shape, backward=backward, batch_shards=batch_shards)
    if problem:
        raise FlashShapeError(f"flash attention refuses q/k/v of shape {tuple(shape)}"
                              f"{' with backward' if backward else ''}: {problem}. Rule: "
                              f"{FLASH_RULE}. Use plain attention (FLASH_ATTENTION = False) "
                              "or lengths the rule allows.")



# ------------------------------------------------------- what FSDPv2's compiled step contains
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COLLECTIVE_OP = re.compile(r"=.*?\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective operations in an HLO module's text, per kind (async ``-start`` halves count
    once, their ``-done`` not at all)."""
    found = Counter(_COLLECTIVE_OP.findall(hlo_text))
    return {kind: found.get(kind, 0) for kind in COLLECTIVES}


def fsdp_step_collectives(width: int, layers: int, heads: int, length: int, rows: int,
                          devices: int = 4, timeout: float = 300, wait: bool = True):
    """The collectives XLA's SPMD partitioner compiled into one FSDPv2 training step of
    :class:`TinyGPT` (forward, backward, AdamW) over ``devices`` virtual XLA:CPU devices,
    ``rows`` sequences of ``length`` tokens split over them.

    The partitioned program exists only after compilation: torch_xla's
    ``_get_xla_tensors_hlo`` returns it when ``XLA_DUMP_POST_OPTIMIZATIONS=1``, a setting read
    once per process (``torch_xla/csrc/ir_dump_util.cpp`` l.269-270, v2.8.0 and v2.9.0) that
    would also change ``xm.get_stablehlo``'s output in the caller. So a child process of its
    own runs the step (on XLA:CPU even on a TPU machine, whose chips the caller holds).
    Returns the counts per kind; with ``wait=False`` at once a ``concurrent.futures.Future``
    of them, so the caller can go on while the child compiles."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
               XLA_DUMP_POST_OPTIMIZATIONS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    args = [sys.executable, "-m", "course.text", "fsdp-collectives",
            *map(str, (width, layers, heads, length, rows))]

    def run() -> dict[str, int]:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"the FSDPv2 step's child process failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    if wait:
        return run()
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def _fsdp_collectives_main(width: int, layers: int, heads: int, length: int, rows: int) -> None:
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2,
    )

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    torch.manual_seed(0)
    device = torch_xla.device()
    model = FSDPv2(TinyGPT(width, layers, heads, max_len=length).to(device), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(1, VOCAB_SIZE, (rows, length)).to(device)
    xs.mark_sharding(tokens, mesh, ("fsdp", None))
    loss = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:])
    loss.backward()
    opt.step()
    state = [t for st in opt.state.values() for t in st.values()
             if torch.is_tensor(t) and t.device.type == "xla"]
    step = [loss, *model.parameters(), *(p.grad for p in model.parameters()), *state]
    print(json.dumps(count_collectives(torch_xla._XLAC._get_xla_tensors_hlo(step))))


if __name__ == "__main__" and sys.argv[1:2] == ["fsdp-collectives"]:
    import warnings

    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    _fsdp_collectives_main(*map(int, sys.argv[2:7]))
