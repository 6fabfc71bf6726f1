"""Hugging Face on XLA, for notebooks 11 and 12 (course code, not toolkit): a byte-level tokenizer
built in memory, Tiny Shakespeare's speeches, a tiny GPT-2 from a config, a ``TrainerCallback``
that counts XLA compiles and host reads per step, and an evaluation that scores every sample
once, in order, at any number of processes (``pad_eval_rows``).

Nothing downloads: the tokenizer is the 256 byte symbols of GPT-2's byte-level alphabet (one
token per UTF-8 byte, as in ``course.text``) plus ``<pad>``; the model is built from a config.
Read against transformers 5.24.0 and accelerate 1.15.0 (``requirements-common.txt``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
)

from course.datasets import data_dir
from course.text import split_speeches
from tpu_helpers.metrics import metric_count
from tpu_helpers.ordering import pad_eval_rows  # noqa: F401  (the toolkit's; was here)

PAD = "<pad>"
#: Label value the loss ignores (transformers' and PyTorch's cross-entropy default).
IGNORE = -100


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0-255) and ``<pad>`` (id 256), built in memory."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 symbols, one per byte
    core = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=PAD)


def speeches(max_bytes: int) -> list[str]:
    """Tiny Shakespeare's speeches (blocks between blank lines) of at most ``max_bytes`` bytes."""
    raw = (data_dir() / "tinyshakespeare" / "input.txt").read_bytes()
    return [s.decode("utf-8") for s in split_speeches(raw) if len(s) <= max_bytes]


def tiny_gpt2(tokenizer, max_len: int, layers: int = 2, width: int = 64, heads: int = 4,
              attn: str = "eager", seed: int = 0) -> GPT2LMHeadModel:
    """A GPT-2 of ``layers`` blocks from a config (random weights, nothing downloaded)."""
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=max_len, n_embd=width,
                        n_layer=layers, n_head=heads, bos_token_id=pad, eos_token_id=pad,
                        pad_token_id=pad)
    model = GPT2LMHeadModel._from_config(config, attn_implementation=attn)
    model.loss_type = "ForCausalLM"  # what the Hub's GPT-2 configs name; unset, transformers warns
    return model


def compiles() -> int:
    """XLA compilations so far in this process."""
    return metric_count("CompileTime")


def host_reads() -> int:
    """Device-to-host transfers so far in this process."""
    return metric_count("TransferFromDeviceTime")


class XlaCounts(TrainerCallback):
    """Per optimizer step: compiles and host reads between one step's start and the next's.

    torch_xla runs (and, for a new graph, compiles) a step's graph when the loader fetches the
    next batch (``MpDeviceLoader`` calls ``torch_xla.sync()``), so a step's work is counted
    from ``on_step_begin`` to the next ``on_step_begin``; the last step is closed at
    ``on_train_end`` (the Trainer's own sync after the epoch).
    """

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []
        self._start: tuple[int, int] | None = None

    def _close(self) -> None:
        if self._start is not None:
            c, r = self._start
            self.rows.append((compiles() - c, host_reads() - r))

    def on_step_begin(self, args, state, control, **kwargs):
        self._close()
        self._start = (compiles(), host_reads())

    def on_train_end(self, args, state, control, **kwargs):
        self._close()
        self._start = None

    @property
    def compiles(self) -> list[int]:
        return [c for c, _ in self.rows]

    @property
    def host_reads(self) -> list[int]:
        return [r for _, r in self.rows]


# ------------------------------------------------------------- exactly-once evaluation


def per_row_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[rows, 2]``: each row's summed next-token loss and its number of labelled tokens
    (for ``Trainer(preprocess_logits_for_metrics=...)``: only these two numbers per row
    leave the device)."""
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    losses = F.cross_entropy(shift_logits.flatten(0, 1), shift_labels.flatten(),
                             ignore_index=IGNORE, reduction="none").view(shift_labels.shape)
    keep = (shift_labels != IGNORE).float()
    return torch.stack([(losses * keep).sum(1), keep.sum(1)], dim=1)


def token_loss(eval_pred) -> dict[str, float]:
    """``compute_metrics``: mean loss per labelled token, and how many rows and tokens counted."""
    rows = np.asarray(eval_pred.predictions, dtype=np.float64)
    return {"token_loss": float(rows[:, 0].sum() / rows[:, 1].sum()),
            "rows": float(len(rows)), "tokens": float(rows[:, 1].sum())}


def shard_rows(n: int, per_replica_batch: int, world_size: int, drop_last: bool) -> list[list[int]]:
    """The sample indices accelerate's ``BatchSamplerShard`` gives each of ``world_size`` ranks
    for an evaluation set of ``n`` (sequential sampler, ``even_batches=True``, the default)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    base = BatchSampler(SequentialSampler(range(n)), per_replica_batch, drop_last)
    return [[i for batch in BatchSamplerShard(base, num_processes=world_size, process_index=r)
             for i in batch] for r in range(world_size)]
