"""Text for notebooks 09 and 10: Tiny Shakespeare as one sample per speech, a byte-level
tokenizer, and the tiny decoder-only language model (course code, not toolkit).

The tokenizer is the simplest that needs nothing downloaded: a token is one UTF-8 byte
(vocabulary 256). Token 0 (NUL, absent from the text) pads. Every speech is checked on the
host: bytes that are not UTF-8 are a :class:`TextError` naming the speech's index.
"""

from __future__ import annotations

import math
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
