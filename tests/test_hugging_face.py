"""Notebook 11's claims about transformers 5.24.0 and accelerate 1.15.0 on XLA, with a real Trainer,
a real Accelerator and real torch_xla (XLA:CPU); FSDPv2 is in tests/test_hf_fsdp.py."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import time

import pytest

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from course.hf import (  # noqa: E402
    IGNORE,
    XlaCounts,
    byte_tokenizer,
    host_reads,
    pad_eval_rows,
    per_row_loss,
    shard_rows,
    speeches,
    tiny_gpt2,
    token_loss,
)

MAX_LEN, B = 32, 4


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=B,
                per_device_eval_batch_size=B, num_train_epochs=1, optim="adamw_torch_xla",
                dataloader_drop_last=True, dataloader_pin_memory=False, report_to="none",
                save_strategy="no", logging_strategy="no", disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def test_versions_are_the_pinned_ones():
    assert transformers.__version__ == "5.24.0" and accelerate.__version__ == "1.15.0"


def test_byte_tokenizer_round_trips_text(tok):
    text = "To be, or not to be: that is the question.\nÆ"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode()) and max(ids) < 256 and tok.pad_token_id == 256
    assert tok.decode(ids) == text


def test_default_trainer_fails_at_the_first_step_and_adamw_torch_xla_trains(tok, tmp_path):
    data = [tok(t, padding="max_length", max_length=MAX_LEN) for t in speeches(MAX_LEN)[:8]]
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    defaults = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                 dataloader_pin_memory=False, disable_tqdm=True)
    assert defaults.optim.value == "adamw_torch_fused"
    with pytest.raises(RuntimeError, match=r"fused=True.*xla"):
        Trainer(model=tiny_gpt2(tok, MAX_LEN), args=defaults, train_dataset=data,
                data_collator=collator).train()
    counts = XlaCounts()
    model = tiny_gpt2(tok, MAX_LEN)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=data,
                      data_collator=collator, callbacks=[counts])
    trainer.train()
    assert type(trainer.optimizer.optimizer).__module__.startswith("torch_xla.amp.syncfree")
    after = [p.detach().cpu() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # fixed shapes, eager attention: two compiles (steps 1 and 2), no host read before the end
    assert len(counts.rows) == 2 and sum(counts.host_reads[:-1]) == 0


def test_sdpa_reads_the_device_every_step_and_eager_never_before_the_end(tok, tmp_path):
    """Notebook 11, section 3: GPT-2's default sdpa attention asks the host whether the mask has
    padding (masking_utils ``_ignore_causal_mask_sdpa``) at every step; eager attention does not."""
    data = [tok(t, padding="max_length", max_length=MAX_LEN) for t in speeches(MAX_LEN)[:12]]
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    reads = {}
    for attn in ("sdpa", "eager"):
        counts = XlaCounts()
        Trainer(model=tiny_gpt2(tok, MAX_LEN, attn=attn), args=_args(tmp_path),
                train_dataset=data, data_collator=collator, callbacks=[counts]).train()
        reads[attn] = counts.host_reads
    assert len(reads["sdpa"]) == len(reads["eager"]) == 3
    assert min(reads["sdpa"]) >= 1 and sum(reads["sdpa"]) > sum(reads["eager"])
    assert sum(reads["eager"][:-1]) == 0


def test_sdpa_reads_once_without_padding_and_twice_with_it(tok):
    """transformers 5.24.0 masking_utils ``_ignore_causal_mask_sdpa``: ``fast_all(padding_mask)``
    (l.292) reads the device once; when the mask has padding, l.298 reads it a second time."""
    import torch_xla

    device = torch_xla.device()
    model = tiny_gpt2(tok, MAX_LEN, attn="sdpa").to(device)
    long = [t for t in speeches(4 * MAX_LEN) if len(t.encode()) > MAX_LEN][:4]
    batches = {"no padding": tok(long, truncation=True, max_length=MAX_LEN, return_tensors="pt"),
               "padding": tok(speeches(MAX_LEN)[:4], padding="max_length", max_length=MAX_LEN,
                              return_tensors="pt")}
    assert batches["no padding"]["attention_mask"].all()
    assert not batches["padding"]["attention_mask"].all()
    reads = {}
    for name, batch in batches.items():
        batch = {k: v.to(device) for k, v in batch.items()}
        torch_xla.sync()
        before = host_reads()
        with torch.no_grad():
            model(**batch)
        torch_xla.sync()
        reads[name] = host_reads() - before
    assert reads == {"no padding": 1, "padding": 2}


def test_autocast_trainer_keeps_float32_weights_after_a_step(tok, tmp_path):
    """Notebook 11, section 6: overriding autocast_smart_context_manager gives bf16 autocast
    with float32 master weights (bf16=False)."""

    class AutocastTrainer(Trainer):
        def autocast_smart_context_manager(self, cache_enabled=True):
            return torch.autocast("xla", dtype=torch.bfloat16)

    data = [tok(t, padding="max_length", max_length=MAX_LEN) for t in speeches(MAX_LEN)[:4]]
    model = tiny_gpt2(tok, MAX_LEN)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    AutocastTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=data,
                    data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).train()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    after = [p.detach().cpu() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_trainer_leaves_autocast_to_accelerate_which_wraps_forward_with_bf16(tok, tmp_path):
    """Notebook 11, section 6: the Trainer's own autocast context is a null context ("We rely on
    accelerate for autocast", trainer.py); with bf16=True on XLA:CPU accelerate's prepare_model
    wraps ``forward`` in an autocast (accelerator.py), a second one under an override."""
    trainer = Trainer(model=tiny_gpt2(tok, MAX_LEN), args=_args(tmp_path, bf16=True))
    assert isinstance(trainer.autocast_smart_context_manager(), contextlib.nullcontext)
    assert "We rely on accelerate for autocast" in Trainer.autocast_smart_context_manager.__doc__
    assert trainer.accelerator.native_amp  # XLA:CPU: autocast; a TPU: XLA_USE_BF16 instead
    model = trainer.accelerator.prepare_model(tiny_gpt2(tok, MAX_LEN))
    assert hasattr(model, "_original_forward") and model.forward.__name__ == "forward"
    assert "autocast_context(model_forward_func)" in inspect.getsource(
        type(trainer.accelerator).prepare_model)


@pytest.mark.parametrize("n", [45, 64, 65, 3])
def test_eight_ranks_gather_duplicates_unless_trimmed(n):
    """accelerate's BatchSamplerShard for 8 simulated ranks: the gathered rows repeat samples
    to even out the last step; gather_for_metrics's trim (remainder = n % global batch) is what
    makes it exactly once, and on XLA it fires when MpDeviceLoader's thread says, not at the
    last batch (the tests below)."""
    world, glob = 8, 8 * B
    ranks = shard_rows(n, B, world, drop_last=False)
    assert len({len(r) for r in ranks}) == 1  # the same number of rows on every rank
    steps = len(ranks[0]) // B
    gathered = [ranks[r][s * B:(s + 1) * B] for s in range(steps) for r in range(world)]
    flat = [i for rows in gathered for i in rows]
    assert sorted(set(flat)) == list(range(n))
    assert len(flat) - n == (-n) % glob  # duplicates kept without the trim
    remainder = n % glob
    trimmed = flat[:(steps - 1) * glob] + (flat[(steps - 1) * glob:][:remainder] if remainder
                                           else flat[(steps - 1) * glob:])
    assert sorted(trimmed) == list(range(n))  # with the trim: exactly once
    dropped = [i for r in shard_rows(n, B, world, drop_last=True) for i in r]
    assert len(set(dropped)) == n // glob * glob  # drop_last: the tail is never scored


@pytest.mark.parametrize("n", [45, 7])
def test_pad_eval_rows_pads_to_the_global_batch_at_world_sizes_1_and_8(n):
    """The padded length is a multiple of per_replica_batch * world_size; accelerate's
    BatchSamplerShard then gives each of the world_size ranks full batches, every row once."""
    rows = [{"input_ids": [i] * 3, "attention_mask": [1] * 3, "labels": [i] * 3} for i in range(n)]
    for world, want in ((1, -(-n // B) * B), (8, -(-n // (8 * B)) * 8 * B)):
        padded = pad_eval_rows(rows, per_replica_batch=B, world_size=world, width=3, pad_id=256)
        assert len(padded) == want and padded[:n] == rows  # the filler rows are the last ones
        assert all(f == {"input_ids": [256] * 3, "attention_mask": [0] * 3, "labels": [IGNORE] * 3}
                   for f in padded[n:])
        for drop_last in (False, True):
            ranks = shard_rows(len(padded), B, world, drop_last=drop_last)
            assert [len(r) for r in ranks] == [len(padded) // world] * world
            assert sorted(i for r in ranks for i in r) == list(range(len(padded)))
    with pytest.raises(ValueError, match="world_size"):
        pad_eval_rows(rows, per_replica_batch=B, world_size=0, width=3, pad_id=256)


def test_end_of_dataloader_is_never_seen_in_the_loop_on_xla():
    """6 batches: fewer than the 8 MpDeviceLoader's transfer thread waits for, so accelerate's
    iterator has set the flag and unregistered before the loop gets its first batch."""
    from accelerate import Accelerator

    acc = Accelerator()
    loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(45), batch_size=8))
    assert type(loader).__name__ == "MpDeviceLoaderWrapper"
    seen, rows = [], 0
    for batch in loader:
        seen.append(acc.gradient_state.end_of_dataloader)
        rows += acc.gather_for_metrics(batch).shape[0]
    assert rows == 45 and not any(seen)


def _wait_for_the_flag(gradient_state, timeout=120.0) -> bool:
    """Hold the loop until accelerate's end-of-loader flag is set (MpDeviceLoader's queues full)."""
    deadline = time.monotonic() + timeout
    while not gradient_state.end_of_dataloader and time.monotonic() < deadline:
        time.sleep(0.005)
    return gradient_state.end_of_dataloader


def test_the_early_flag_cuts_batches_1_to_7_of_a_33_batch_loader():
    """The race made certain (notebook 11, section 5): the loop holds batch 1 until the flag is set.
    MpDeviceLoader's queues then hold batches 2-9 (device, 8), 10-16 (the transfer thread) and
    17-32 (host, 16); accelerate's iterator has read past batch 33, set the flag (data_loader.py
    l.604) and waits to queue 33. It unregisters (l.611) only once the transfer thread takes
    17-24, after the loop took batch 8: gather_for_metrics cuts batches 1-7 to remainder rows.
    Padded to remainder 0, the same early flag cuts nothing."""
    from accelerate import Accelerator

    acc = Accelerator()
    rows, flag = {}, {}
    for n in (32 * 8 + 5, 33 * 8):
        loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(n), batch_size=8))
        it = iter(loader)
        first = next(it)
        flag[n] = _wait_for_the_flag(acc.gradient_state)
        rows[n] = [acc.gather_for_metrics(first).shape[0]]
        rows[n] += [acc.gather_for_metrics(batch).shape[0] for batch in it]
    assert flag == {261: True, 264: True} and len(rows[261]) == len(rows[264]) == 33
    assert rows[261][:7] == [5] * 7 and sum(rows[261]) <= 261 - 7 * 3
    assert rows[264] == [8] * 33


class _HoldFirstBatch(TrainerCallback):
    """At the first prediction step, wait for the flag, as a slow first step (a compile) does."""

    def __init__(self):
        self.trainer, self.flag = None, None

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.flag is None:
            self.flag = _wait_for_the_flag(self.trainer.accelerator.gradient_state)


def test_the_early_trim_loses_rows_and_padding_returns_every_row(tok, tmp_path):
    """A real Trainer.predict, one replica, drop_last=False, 261 rows (33 batches, remainder 5),
    held at its first batch: batches 2-7 are gathered with the flag set, at least 18 rows lost,
    no warning. Padded to 264 (pad_eval_rows), every row comes back, in order."""
    texts = speeches(MAX_LEN)[:261]
    feats = [{**f, "labels": [t if m else IGNORE for t, m in
                              zip(f["input_ids"], f["attention_mask"], strict=True)]}
             for f in (tok(t, padding="max_length", max_length=MAX_LEN) for t in texts)]
    model = tiny_gpt2(tok, MAX_LEN, layers=1)
    out = {}
    for name, rows in (("given", feats), ("padded", pad_eval_rows(
            feats, per_replica_batch=8, world_size=1, width=MAX_LEN, pad_id=tok.pad_token_id))):
        hold = _HoldFirstBatch()
        trainer = Trainer(model=model, args=_args(tmp_path, per_device_eval_batch_size=8,
                                                  dataloader_drop_last=False),
                          preprocess_logits_for_metrics=per_row_loss, callbacks=[hold])
        hold.trainer = trainer
        out[name] = (trainer.predict(rows), rows, hold.flag)
    given, _, flag = out["given"]
    assert flag and len(given.label_ids) <= 261 - 6 * 3
    padded, rows, flag = out["padded"]
    assert flag and len(rows) == 264 and len(padded.label_ids) == 264
    assert np.array_equal(padded.label_ids, [f["labels"] for f in rows])


def test_drop_last_drops_eval_samples_and_padded_eval_counts_each_token_once(tok, tmp_path):
    texts = speeches(MAX_LEN)[-10:]
    feats = [tok(t, padding="max_length", max_length=MAX_LEN) for t in texts]
    model = tiny_gpt2(tok, MAX_LEN)
    out = Trainer(model=model, args=_args(tmp_path),
                  data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).predict(feats)
    assert out.predictions.shape[0] == 8  # 10 samples, batches of 4, drop_last: 2 never scored
    labelled = [{**f, "labels": [t if m else -100 for t, m in
                                 zip(f["input_ids"], f["attention_mask"], strict=True)]}
                for f in feats]
    padded = pad_eval_rows(labelled, per_replica_batch=B, world_size=1, width=MAX_LEN,
                           pad_id=tok.pad_token_id)
    assert len(padded) == 12
    metrics = Trainer(model=model, args=_args(tmp_path), compute_metrics=token_loss,
                      preprocess_logits_for_metrics=per_row_loss).evaluate(padded)
    real = sum(sum(1 for t in f["labels"][1:] if t != -100) for f in labelled)
    assert metrics["eval_tokens"] == real and metrics["eval_rows"] == 12
    # the same number on the host, one sample at a time
    with torch.no_grad():
        cpu = tiny_gpt2(tok, MAX_LEN)
        cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        rows = torch.cat([per_row_loss(cpu(input_ids=torch.tensor([f["input_ids"]])).logits,
                                       torch.tensor([f["labels"]])) for f in labelled])
    assert metrics["eval_token_loss"] == pytest.approx(float(rows[:, 0].sum() / rows[:, 1].sum()),
                                                       rel=1e-4)


def test_bf16_on_a_tpu_means_xla_use_bf16_in_accelerate_source():
    from accelerate import state
    from accelerate.utils import imports

    src = inspect.getsource(state)
    assert 'os.environ["XLA_USE_BF16"] = str(1)' in src
    assert "return not ignore_tpu" in inspect.getsource(imports.is_bf16_available)


def test_tpu_cluster_launch_imports_a_module_torch_xla_2_lacks():
    from accelerate.commands import launch

    source = inspect.getsource(launch.tpu_pod_launcher)
    assert "from torch_xla.distributed import xla_dist" in source
    assert importlib.util.find_spec("torch_xla.distributed.xla_dist") is None
