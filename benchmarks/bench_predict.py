"""Prediction with exactly-once gathering vs a bare forward loop over the same batches.

Claim (notebook 04, README): ``tpu_helpers.predict.predict`` costs at most 1.15x a bare
forward loop that only runs the model and copies the outputs to the host once, and its
host memory stays at the final result plus one chunk.

* Speed: both build and run the same padded loader (``make_eval_loader``, batch 64, digits
  images tiled to ``rows`` samples, the digits CNN) through ``MpDeviceLoader`` on this
  process's XLA device (world size 1: ``xm.all_gather`` is an identity but is still
  traced into the step graph). Each is warmed up once (compiles), then timed
  ``repeats`` times alternately; the best time of each is compared (robust to other
  processes on a shared machine); ``paired_median_ratio`` is the median of the ratios
  of back-to-back runs. ``cpu_ratio`` compares the CPU seconds the process
  used (all threads, XLA:CPU's included), which contention inflates much less.
* Memory: a wide linear model (1024 outputs per row) so the result is tens of MB; peak
  resident memory above the start (sampled every 2 ms) and the peak of numpy's own
  allocations (tracemalloc), with a small ``chunk_bytes`` and with one chunk for the
  whole run. On XLA:CPU "device" buffers are host memory too, so the resident figure
  also holds the gathered-but-not-yet-fetched chunk on the device side.

``python -m benchmarks.bench_predict [--quick]``; ``run(quick)`` returns the rows for
``benchmarks/run_all.py``. Uses the XLA device of this process (one device, no SPMD).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import tracemalloc

import numpy as np
import torch

from benchmarks._common import quick_mode

GOAL_RATIO = 1.15


def _dataset(rows: int):
    from course.datasets import load_digits
    from tpu_helpers.data import ArrayDataset

    x, y = load_digits()
    reps = -(-rows // len(x))
    return ArrayDataset(np.tile(x, (reps, 1, 1, 1))[:rows], np.tile(y, reps)[:rows])


def bare_forward(model, dataset, batch_size: int, device) -> torch.Tensor:
    """The baseline as a user writes it: forward every batch, one copy to the host."""
    import torch_xla.distributed.parallel_loader as pl

    from tpu_helpers.data import make_eval_loader

    loader = make_eval_loader(dataset, batch_size, world_size=1, rank=0)
    outs = []
    with torch.no_grad():
        for x, _y, _index, _mask in pl.MpDeviceLoader(loader, device):
            outs.append(model(x))
    return torch.cat(outs).cpu()  # padding rows included: nothing ordered or checked


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all threads, XLA:CPU's included)."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    xm.wait_device_ops()
    return time.perf_counter() - t0, time.process_time() - c0


def speed(rows: int, batch_size: int = 64, repeats: int = 3) -> dict:
    import torch_xla

    from course.models import DigitsCNN
    from tpu_helpers.data import make_eval_loader
    from tpu_helpers.metrics import snapshot
    from tpu_helpers.predict import predict

    device = torch_xla.device()
    torch.manual_seed(0)
    model = DigitsCNN().eval().to(device)
    ds = _dataset(rows)
    before = snapshot()
    ref = bare_forward(model, ds, batch_size, device)  # warm-up: compiles
    base_compiles = (snapshot() - before).compiles

    def ours():  # the same padded loader as the baseline, then predict
        return predict(model, make_eval_loader(ds, batch_size, world_size=1, rank=0))

    warm = ours()
    assert np.allclose(warm.values, ref[:rows].numpy(), atol=1e-5), "predict != bare loop"
    bare_s, ours_s, timed_compiles = [], [], 0
    for _ in range(repeats):
        bare_s.append(_timed(lambda: bare_forward(model, ds, batch_size, device)))
        result: list = []
        ours_s.append(_timed(lambda out=result: out.append(ours())))
        timed_compiles += result[0].compiles
    best_bare, best_ours = min(bare_s), min(ours_s)
    ratio = best_ours[0] / best_bare[0]
    return {"benchmark": "predict", "case": f"gather+order vs bare forward, {rows} rows, "
            f"batch {batch_size}", "baseline_s": round(best_bare[0], 4),
            "candidate_s": round(best_ours[0], 4), "ratio": round(ratio, 3),
            "goal": f"<= {GOAL_RATIO}", "ok": ratio <= GOAL_RATIO,
            "paired_median_ratio": round(float(np.median(
                [o[0] / b[0] for o, b in zip(ours_s, bare_s, strict=True)])), 3),
            "cpu_ratio": round(min(c for _, c in ours_s) / min(c for _, c in bare_s), 3),
            "compiles_predict_warmup": warm.compiles, "compiles_baseline_warmup": base_compiles,
            "compiles_timed_runs": timed_compiles,
            "transfers_per_predict": warm.transfers_from_device}


class _PeakRss:
    """Peak resident set size above the start, sampled in a thread every 2 ms."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


def memory(rows: int, chunk_bytes: int, width: int = 1024, batch_size: int = 64) -> dict:
    import torch_xla

    from tpu_helpers.data import make_eval_loader
    from tpu_helpers.predict import PredictOptions, predict

    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, width)).to(device)
    ds = _dataset(rows)
    first = torch.utils.data.Subset(ds, range(batch_size))
    predict(model, make_eval_loader(first, batch_size, world_size=1, rank=0))  # compile
    loader = make_eval_loader(ds, batch_size, world_size=1, rank=0)
    result_bytes = rows * width * 4
    tracemalloc.start()
    with _PeakRss() as rss:
        pred = predict(model, loader, options=PredictOptions(chunk_bytes=chunk_bytes))
    _, numpy_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    step_bytes = batch_size * (width * 4 + 16)
    chunk = max(1, chunk_bytes // step_bytes) * step_bytes
    chunk = min(chunk, -(-rows // batch_size) * step_bytes)
    mib = 1 << 20
    return {"benchmark": "predict", "case": f"host memory, {rows} x {width} float32, "
            f"chunk_bytes={chunk_bytes}", "result_MiB": round(result_bytes / mib, 1),
            "chunk_MiB": round(chunk / mib, 2),
            "numpy_peak_MiB": round(numpy_peak / mib, 1),
            "rss_growth_MiB": round(rss.growth / mib, 1),
            "transfers": pred.transfers_from_device,
            "ok": numpy_peak <= result_bytes + 2 * chunk + (1 << 20)}


def run(quick: bool) -> list[dict]:
    """Rows for ``benchmarks/run_all.py``: one speed row, two memory rows."""
    import torch_xla.runtime as xr

    if xr.is_spmd():
        raise RuntimeError("bench_predict runs on one XLA device; this process is in SPMD "
                           "mode (run it in a fresh process).")
    rows = 1797 * (2 if quick else 8)
    out = [speed(rows, repeats=5 if quick else 9)]
    mem_rows = 4096 if quick else 16384
    out.append(memory(mem_rows, chunk_bytes=1 << 20))
    out.append(memory(mem_rows, chunk_bytes=1 << 40))  # one chunk: the whole run at once
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repeats")
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    import pandas as pd

    rows = run(quick_mode(args.quick))
    speed_row, mem_rows = rows[0], rows[1:]
    print(pd.Series(speed_row).to_string(), end="\n\n")
    print(pd.DataFrame(mem_rows).drop(columns="benchmark").set_index("case").to_string(),
          end="\n")
    print(f"\npredict / bare forward = {speed_row['ratio']:.3f}x (goal <= {GOAL_RATIO}x); "
          f"compiles: predict {speed_row['compiles_predict_warmup']} at warm-up, "
          f"{speed_row['compiles_timed_runs']} in the timed runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
