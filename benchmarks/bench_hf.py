"""Hugging Face benchmark: the Trainer as a new user runs it, with notebook 11's settings, and
the course's own loop, on the same model and data.

    python -m benchmarks.bench_hf            # full run (about 2 minutes on 2 idle cores)
    python -m benchmarks.bench_hf --quick    # CI-sized

Every row trains notebook 11's tiny GPT-2 (``course.hf.tiny_gpt2``: byte tokens, width 64, 4
heads) on Tiny Shakespeare's speeches of at most 64 bytes, 8 rows per step, with torch_xla's
``syncfree.AdamW`` (lr 5e-5, the Trainer's default rate) on one XLA:CPU device:

  (a) ``Trainer``, defaults except ``optim="adamw_torch_xla"``, the one change without which
      it fails at step 1 (the default fused AdamW refuses XLA tensors): the default collator
      pads each batch to its longest, GPT-2's default ``sdpa`` attention, ``drop_last`` off.
  (b) ``Trainer`` with notebook 11's settings: every row padded to 64 tokens, eager attention,
      ``dataloader_drop_last=True``.
  (c) the course's loop on (b)'s model, batches and optimizer: ``DataLoader`` +
      ``pl.MpDeviceLoader``, forward, backward, ``xm.optimizer_step``, ``zero_grad``; no
      gradient clipping and no schedule (the Trainer does both by default).

Each row runs in its own Python process (its compile counts are its own). The first
``warmup`` steps compile; from the start of step ``warmup + 1`` to the device's end of the last
step (``xm.wait_device_ops()``) is the timed window. Reported: host milliseconds per step in that
window (wall and this process's CPU time), its ratio to (c), compiles in warm-up and after
it, and device-to-host transfers and graph executions per step after warm-up (all from
``torch_xla.debug.metrics``). On a TPU a step of a model this small takes far less device
time than host time, so host milliseconds per step are its throughput (expected, not yet
run on a TPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import quick_mode

REPO = Path(__file__).resolve().parent.parent
MAX_LEN, PER_REPLICA_BATCH, LR, SEED = 64, 8, 5e-5, 0
ROWS = {"a": "(a) Trainer, defaults + adamw_torch_xla", "b": "(b) Trainer, notebook 11 settings",
        "c": "(c) the course's loop"}


def settings(quick: bool) -> dict[str, int]:
    """Speeches per epoch (a multiple of the batch), epochs, warm-up steps, GPT-2 blocks."""
    if quick:
        return {"speeches": 64, "epochs": 1, "warmup": 3, "layers": 1}
    return {"speeches": 160, "epochs": 3, "warmup": 3, "layers": 2}


def counters() -> dict[str, int]:
    from tpu_helpers.metrics import snapshot

    now = snapshot()
    return {"compiles": now.compiles, "transfers": now.transfers_from_device,
            "executions": now.executions}


class Clock:
    """Counters and clocks when step ``warmup + 1`` begins, and at the end of the run.

    A step's graph runs (and compiles) when the loader fetches the next batch
    (``MpDeviceLoader`` syncs then), so step ``warmup`` has compiled when step ``warmup + 1``
    begins; the timed window is steps ``warmup + 1`` to the last, until the device is done."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.steps, self.marks = warmup, 0, {}

    def mark(self, name: str) -> None:
        self.marks[name] = {**counters(), "wall": time.perf_counter(), "cpu": time.process_time()}

    def step_begins(self) -> None:
        self.steps += 1
        if self.steps == self.warmup + 1:
            self.mark("warm")

    def finish(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
        self.mark("end")
        start, end, timed = self.marks["warm"], self.marks["end"], self.steps - self.warmup
        return {"steps": self.steps, "compiles_warmup": start["compiles"],
                "compiles_after_warmup": end["compiles"] - start["compiles"],
                "transfers_per_step": (end["transfers"] - start["transfers"]) / timed,
                "executions_per_step": (end["executions"] - start["executions"]) / timed,
                "ms_per_step": 1e3 * (end["wall"] - start["wall"]) / timed,
                "cpu_ms_per_step": 1e3 * (end["cpu"] - start["cpu"]) / timed}


def data(cfg: dict[str, int]):
    from course.hf import byte_tokenizer, speeches

    tok = byte_tokenizer()
    texts = (speeches(MAX_LEN) * 4)[: cfg["speeches"]]
    dynamic = [tok(t) for t in texts]
    fixed = [tok(t, padding="max_length", max_length=MAX_LEN) for t in texts]
    return tok, dynamic, fixed


def run_trainer(key: str, cfg: dict[str, int], clock: Clock) -> None:
    from transformers import (
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from course.hf import tiny_gpt2

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.step_begins()

    tok, dynamic, fixed = data(cfg)
    tuned = key == "b"
    model = tiny_gpt2(tok, MAX_LEN, layers=cfg["layers"], attn="eager" if tuned else "sdpa")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=PER_REPLICA_BATCH,
                                 num_train_epochs=cfg["epochs"], learning_rate=LR,
                                 optim="adamw_torch_xla", dataloader_drop_last=tuned,
                                 dataloader_pin_memory=False, report_to="none",
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                 seed=SEED)
        Trainer(model=model, args=args, train_dataset=fixed if tuned else dynamic,
                data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                callbacks=[Steps()]).train()


def run_course_loop(cfg: dict[str, int], clock: Clock) -> None:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    from torch_xla.amp.syncfree import AdamW
    from transformers import DataCollatorForLanguageModeling

    from course.hf import tiny_gpt2

    tok, _, fixed = data(cfg)
    device = torch_xla.device()
    model = tiny_gpt2(tok, MAX_LEN, layers=cfg["layers"], attn="eager").to(device).train()
    optimizer = AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    torch.manual_seed(SEED)
    loader = torch.utils.data.DataLoader(fixed, batch_size=PER_REPLICA_BATCH, shuffle=True,
                                         drop_last=True,
                                         collate_fn=DataCollatorForLanguageModeling(tok, mlm=False))
    for _ in range(cfg["epochs"]):
        for batch in pl.MpDeviceLoader(loader, device):
            clock.step_begins()
            model(**batch).loss.backward()
            xm.optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)


def measure_row(key: str, cfg: dict[str, int]) -> dict[str, Any]:
    """One row, in this process (call it in a fresh one: compile counts are per process)."""
    import warnings

    from transformers.utils import logging as hf_logging

    from tpu_helpers.env import configure_emulation

    configure_emulation(num_devices=1)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    clock = Clock(cfg["warmup"])
    if key == "c":
        run_course_loop(cfg, clock)
    else:
        run_trainer(key, cfg, clock)
    return {"benchmark": "hf", "key": key, "name": ROWS[key], **clock.finish()}


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every row, each in its own process; ratios against (c) in this run."""
    cfg = settings(quick_mode(quick))
    rows = []
    for key in ROWS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            subprocess.run([sys.executable, "-m", "benchmarks.bench_hf", "--row", key,
                            "--cfg", json.dumps(cfg), "--out", str(out)], cwd=REPO, check=True)
            rows.append(json.loads(out.read_text()))
    course = next(r for r in rows if r["key"] == "c")
    for r in rows:
        r["ratio_vs_course_loop"] = r["ms_per_step"] / course["ms_per_step"]
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{r['name']:42s} {r['ms_per_step']:6.1f} ms/step ({r['ratio_vs_course_loop']:.2f}x (c)), "
        f"CPU {r['cpu_ms_per_step']:6.1f} ms/step, compiles {r['compiles_warmup']} + "
        f"{r['compiles_after_warmup']} after warm-up, transfers/step "
        f"{r['transfers_per_step']:.2f}, executions/step {r['executions_per_step']:.2f}, "
        f"{r['steps']} steps" for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run")
    parser.add_argument("--row", choices=sorted(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        row = measure_row(args.row, json.loads(args.cfg))
        Path(args.out).write_text(json.dumps(row))
        return 0
    print(format_rows(run(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
