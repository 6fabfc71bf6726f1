"""Text benchmark: padding strategies, autocast vs float32, and `scan` compile time.

    python -m benchmarks.bench_text            # full run (about 2 minutes on 2 idle cores)
    python -m benchmarks.bench_text --quick    # CI-sized

One process, one XLA:CPU device, notebook 09's setup: Tiny Shakespeare, one sample per speech
of at most 256 bytes, byte tokens, the tiny decoder ``course.text.TinyGPT`` trained with plain
SGD, the step compiled with ``torch_xla.compile(step, full_graph=True)``.

1. Padding ("padding" rows): real (unpadded) tokens per second of

   (a) pad each batch of 16 to its longest: a new longest length is a new shape, a new compile
   (b) pad every batch of 16 to the maximum (256): one shape, mostly padding
   (c) length buckets (``tpu_helpers.buckets``: 64/128/256 tokens, 32/16/8 speeches per batch)

   Warm-up: one step of (a) and (b) and one step of each bucket of (c), so (b) and (c) have
   compiled everything they will ever need. Then rounds take turns, (b), (c), (a), each timing
   ``steps`` steps (ended by ``xm.wait_device_ops()``); (a) draws new random batches, as
   training does, and runs in the first round only (nearly every step of it compiles).
   Reported: the median round's real tokens/s and its ratio to (b) in
   the same run, compiles in warm-up and after it (exact: torch_xla's ``CompileTime`` count),
   the new shapes each strategy met (the compile cache is per process, so a shape another
   strategy compiled first is not compiled again), and the padding share of the timed steps.
   Goals: (c) >= 1.3x the real tokens/s of (b) with compiles == number of buckets, and 0
   compiles after warm-up.

2. Precision ("precision" rows): step time of float32, ``torch.autocast("xla",
   dtype=torch.bfloat16)`` around forward and loss, and pure bfloat16 weights
   (``model.to(torch.bfloat16)``), AdamW, the 128-token bucket; and the bytes of parameters +
   gradients + optimizer state per parameter (the tensors themselves, summed: autocast keeps
   float32 master weights, so 4 + 4 + 8 = 16, the same as float32). Activation memory is not
   measured (XLA:CPU reports no device memory). XLA:CPU has no bfloat16 units: it converts,
   so autocast is not faster here; what it gains on a TPU is not measured here.

3. ``scan`` ("scan" rows): seconds to trace and compile forward + backward of 2, 8 and 16
   transformer blocks (``course.text.Block``, width 64) written as a Python loop and with
   ``torch_xla.experimental.scan_layers.scan_layers`` (the same signature in 2.8 and 2.9),
   which compiles one block and loops over the stacked weights. Reported: wall seconds of the
   first call (tracing, lowering and compiling) and XLA's own ``CompileTime`` seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from benchmarks._common import quick_mode
from tpu_helpers.env import configure_emulation

BOUNDS = (64, 128, 256)     # bucket lengths (tokens = bytes), as in notebook 09
BATCH = 16                  # speeches per batch for (a) and (b)
BUCKET_BATCH = (32, 16, 8)  # global batch per bucket for (c) (one replica: all of it):
                            # about the same tokens per step
WIDTH, HEADS, LR, SEED = 64, 4, 0.5, 0
STRATEGIES = {"a": "(a) pad each batch to its longest", "b": "(b) pad to the maximum (256)",
              "c": "(c) length buckets (tpu_helpers.buckets)"}


def settings(quick: bool) -> dict[str, Any]:
    """The knobs. (a) runs one round only: nearly every step compiles, so more rounds would
    time the compiler again. ``quick`` is the CI-sized run."""
    if quick:
        return {"layers": 1, "steps": 4, "rounds": 1, "a_rounds": 1, "precision_steps": 3,
                "depths": (2, 4)}
    return {"layers": 2, "steps": 8, "rounds": 3, "a_rounds": 1, "precision_steps": 10,
            "depths": (2, 8, 16)}


def compiles() -> int:
    import torch_xla.debug.metrics as met

    return int((met.metric_data("CompileTime") or [0])[0])


def compile_seconds() -> float:
    import torch_xla.debug.metrics as met

    return float((met.metric_data("CompileTime") or [0, 0])[1]) / 1e9  # total ns


def make_step(model, optimizer, autocast: bool = False):
    """The training step of notebook 09 (masked next-byte loss), compiled as one graph."""
    import torch
    import torch.nn.functional as F
    import torch_xla

    def step(tokens, mask):
        optimizer.zero_grad(set_to_none=True)  # at the start: the gradients stay readable
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
            losses = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                     reduction="none")
            keep = mask[:, 1:].flatten().float()
            loss = (losses * keep).sum() / keep.sum()
        loss.backward()
        optimizer.step()
        return loss.detach()
    return torch_xla.compile(step, full_graph=True)


def pad(rows, width: int):
    """Token rows padded with 0 to ``width``: (tokens [B, width], real-token mask)."""
    import torch

    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.as_tensor(row)
    return tokens, tokens != 0


def padding_batches(speeches, rounds: int, steps: int) -> dict[str, list[list]]:
    """Per strategy: the warm-up batches, then ``rounds`` lists of ``steps`` batches."""
    import numpy as np

    from tpu_helpers.buckets import BucketDataset, BucketSampler, collate

    def random_rows(seed):
        rng = np.random.default_rng([SEED, seed])
        return [[speeches[i] for i in rng.choice(len(speeches), BATCH, replace=False)]
                for _ in range(steps)]

    rows = [random_rows(r) for r in range(rounds)]
    warm_rows = random_rows(1000)[0]
    data = BucketDataset(speeches, BOUNDS, vocab_size=256)
    plan = BucketSampler(data.buckets, global_batch=BUCKET_BATCH, seed=SEED).steps()
    first = [next(chunk for b, chunk in plan if b == k) for k in range(len(BOUNDS))]

    def bucket_batch(chunk):
        batch = collate([data[int(i)] for i in chunk.reshape(-1)])
        return batch["tokens"], batch["mask"]
    if len(plan) < rounds * steps:
        raise ValueError(f"the bucket plan has {len(plan)} steps, fewer than {rounds * steps}")
    return {
        "a": [[pad(warm_rows, max(map(len, warm_rows)))]]
        + [[pad(r, max(map(len, r))) for r in rnd] for rnd in rows],
        "b": [[pad(warm_rows, BOUNDS[-1])]] + [[pad(r, BOUNDS[-1]) for r in rnd] for rnd in rows],
        "c": [[bucket_batch(c) for c in first]]
        + [[bucket_batch(c) for _, c in plan[r * steps:(r + 1) * steps]] for r in range(rounds)],
    }


def _run_batches(step, batches, device) -> tuple[float, int, int]:
    """Seconds for ``batches`` (to the end of the last execution), real tokens, token slots."""
    import torch_xla.core.xla_model as xm

    start = time.perf_counter()
    for tokens, mask in batches:
        step(tokens.to(device), mask.to(device))
    xm.wait_device_ops()
    return (time.perf_counter() - start, sum(int(m.sum()) for _, m in batches),
            sum(m.numel() for _, m in batches))


def measure_padding(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The three padding strategies, interleaved in rounds: one row each."""
    import torch
    import torch_xla

    from course.text import TinyGPT, load_speeches

    device = torch_xla.device()
    batches = padding_batches(load_speeches(BOUNDS[-1]), cfg["rounds"], cfg["steps"])
    steps, stats, seen = {}, {}, set()
    for key in ("b", "c", "a"):  # warm-up: (b) and (c) compile all they will ever need
        torch.manual_seed(SEED)
        model = TinyGPT(WIDTH, cfg["layers"], HEADS, max_len=BOUNDS[-1]).to(device)
        steps[key] = make_step(model, torch.optim.SGD(model.parameters(), lr=LR))
        shapes = {tuple(t.shape) for t, _ in batches[key][0]}
        before = compiles()
        _run_batches(steps[key], batches[key][0], device)
        stats[key] = {"compiles_warmup": compiles() - before, "compiles_after_warmup": 0,
                      "new_shapes_warmup": len(shapes - seen), "new_shapes_after": 0,
                      "rates": [], "real": 0, "slots": 0, "shapes": set(shapes)}
        seen |= shapes
    for r in range(cfg["rounds"]):
        for key in ("b", "c", "a") if r < cfg["a_rounds"] else ("b", "c"):
            s, rnd = stats[key], batches[key][1 + r]
            shapes = {tuple(t.shape) for t, _ in rnd}
            s["new_shapes_after"] += len(shapes - seen)
            seen |= shapes
            s["shapes"] |= shapes
            before = compiles()
            seconds, real, slots = _run_batches(steps[key], rnd, device)
            s["compiles_after_warmup"] += compiles() - before
            s["rates"].append(real / seconds)
            s["real"] += real
            s["slots"] += slots
    base = statistics.median(stats["b"]["rates"])
    rows = []
    for key in ("a", "b", "c"):
        s = stats[key]
        rate = statistics.median(s["rates"])
        rows.append({
            "benchmark": "text", "part": "padding", "key": key, "name": STRATEGIES[key],
            "real_tokens_per_s": rate, "min_rate": min(s["rates"]), "max_rate": max(s["rates"]),
            "ratio_vs_pad_to_max": rate / base, "padding_share": 1 - s["real"] / s["slots"],
            "compiles_warmup": s["compiles_warmup"],
            "compiles_after_warmup": s["compiles_after_warmup"],
            "new_shapes_warmup": s["new_shapes_warmup"], "new_shapes_after": s["new_shapes_after"],
            "distinct_shapes": len(s["shapes"]), "steps_timed": len(s["rates"]) * cfg["steps"],
            "rounds": len(s["rates"]), "buckets": len(BOUNDS),
        })
    return rows


def state_bytes_per_parameter(model, optimizer) -> float:
    """Bytes of parameters + gradients + optimizer state tensors, per parameter."""
    import torch

    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)  # not the step counters
    return total / sum(p.numel() for p in params)


def measure_precision(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """float32, autocast bf16 and pure bf16: step time (interleaved rounds), bytes/param."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from course.text import TinyGPT, load_speeches

    device = torch_xla.device()
    rows_ = [s for s in load_speeches(BOUNDS[1]) if len(s) > BOUNDS[0]]
    batch = pad(rows_[:BUCKET_BATCH[1]], BOUNDS[1])
    batch = (batch[0].to(device), batch[1].to(device))
    cases = {"float32": (torch.float32, False), "autocast bf16": (torch.float32, True),
             "pure bf16 weights": (torch.bfloat16, False)}
    steps, out = {}, {}
    for name, (dtype, autocast) in cases.items():
        torch.manual_seed(SEED)
        model = TinyGPT(WIDTH, cfg["layers"], HEADS, max_len=BOUNDS[-1]).to(device, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps[name] = make_step(model, opt, autocast)
        before = compiles()
        steps[name](*batch)  # warm-up; then the gradients and AdamW's state exist
        xm.wait_device_ops()
        out[name] = {"bytes_per_param": state_bytes_per_parameter(model, opt),
                     "compiles": compiles() - before, "times": []}
    for _ in range(cfg["rounds"]):
        for name in cases:
            start = time.perf_counter()
            for _ in range(cfg["precision_steps"]):
                steps[name](*batch)
            xm.wait_device_ops()
            out[name]["times"].append((time.perf_counter() - start) / cfg["precision_steps"])
    base = statistics.median(out["float32"]["times"])
    return [{"benchmark": "text", "part": "precision", "name": name,
             "ms_per_step": 1000 * statistics.median(o["times"]),
             "min_ms": 1000 * min(o["times"]), "max_ms": 1000 * max(o["times"]),
             "ratio_vs_float32": statistics.median(o["times"]) / base,
             "bytes_per_param": o["bytes_per_param"], "compiles": o["compiles"],
             "batch": list(batch[0].shape)} for name, o in out.items()]


def measure_scan(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Trace + compile seconds of forward and backward through N blocks, loop vs scan."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch import nn
    from torch_xla.experimental.scan_layers import scan_layers

    from course.text import Block

    device = torch_xla.device()
    rows = []
    for depth in cfg["depths"]:
        for use_scan in (False, True):
            torch.manual_seed(SEED)
            layers = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(depth)).to(device)
            x = torch.randn(8, 64, WIDTH).to(device).requires_grad_()
            torch_xla.sync()
            before, secs, start = compiles(), compile_seconds(), time.perf_counter()
            if use_scan:
                y = scan_layers(layers, x)
            else:
                y = x
                for layer in layers:
                    y = layer(y)
            y.square().mean().backward()
            torch_xla.sync()
            xm.wait_device_ops()
            rows.append({"benchmark": "text", "part": "scan", "layers": depth, "scan": use_scan,
                         "name": f"{depth} blocks, {'scan_layers' if use_scan else 'for loop'}",
                         "first_call_s": time.perf_counter() - start,
                         "compile_s": compile_seconds() - secs,
                         "compiles": compiles() - before})
    for r in rows:
        loop = next(o for o in rows if o["layers"] == r["layers"] and not o["scan"])
        r["ratio_vs_loop"] = r["first_call_s"] / loop["first_call_s"]
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    """All three parts in this process (one XLA:CPU device); one dict per row."""
    configure_emulation(num_devices=1)
    cfg = settings(quick)
    return measure_padding(cfg) + measure_precision(cfg) + measure_scan(cfg)


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        if r["part"] == "padding":
            lines.append(f"{r['name']:44s} real tok/s {r['real_tokens_per_s']:7.0f} "
                         f"({r['min_rate']:.0f}-{r['max_rate']:.0f}) "
                         f"{r['ratio_vs_pad_to_max']:.2f}x pad-to-max, padding "
                         f"{r['padding_share']:.0%}, compiles {r['compiles_warmup']} + "
                         f"{r['compiles_after_warmup']} after warm-up")
        elif r["part"] == "precision":
            lines.append(f"{r['name']:44s} {r['ms_per_step']:6.1f} ms/step "
                         f"({r['min_ms']:.1f}-{r['max_ms']:.1f}) {r['ratio_vs_float32']:.2f}x "
                         f"float32, {r['bytes_per_param']:.1f} bytes/param (weights+grads+AdamW)")
        else:
            lines.append(f"{r['name']:44s} first call {r['first_call_s']:5.1f} s "
                         f"({r['ratio_vs_loop']:.2f}x loop), XLA compile {r['compile_s']:5.1f} s,"
                         f" {r['compiles']} compiles")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and layers (CI)")
    ap.add_argument("--part", choices=("padding", "precision", "scan"), help="only one part")
    args = ap.parse_args(argv)
    quick = quick_mode(args.quick)
    configure_emulation(num_devices=1)
    start = time.perf_counter()
    parts = {"padding": measure_padding, "precision": measure_precision, "scan": measure_scan}
    rows = parts[args.part](settings(quick)) if args.part else run(quick)
    print(format_rows(rows))
    print(f"({time.perf_counter() - start:.0f} s; XLA:CPU, one device; timings are inflated by "
          "other load on this machine, compile counts are exact)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
