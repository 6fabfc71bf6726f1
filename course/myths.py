"""Notebook 08's plumbing: run a function in forked processes joined by ``torch.distributed``.

``run_ranks(fn)`` forks ``world_size`` processes with the usual ``torch.distributed`` variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), runs ``fn(rank)`` in each on XLA:CPU
and returns the results in rank order. A rank's exception comes back as the exception, a hang
becomes a timeout. Forking is safe only while the calling process has not started the XLA runtime,
so that is checked first. Each rank's C++ output (gloo prints a line per connection) goes to a file
of its own, printed afterwards, rank by rank.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

from tpu_helpers.env import runtime_initialized


def _rank_main(fn: Callable[[int], Any], rank: int, port: int, world_size: int) -> tuple[Any, str]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    with tempfile.TemporaryFile("w+") as log:
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)  # this rank's C++ output (gloo's lines) goes to its own file
        try:
            result = fn(rank)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        return result, log.read()


def run_ranks(fn: Callable[[int], Any], world_size: int = 2, timeout: float = 120) -> list:
    """``[fn(0), ..., fn(world_size - 1)]``, each in a forked process (see the module's text)."""
    if runtime_initialized():
        raise RuntimeError("XLA already started in this kernel: restart it, run the cells in order")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with multiprocessing.get_context("fork").Pool(world_size) as pool:
        jobs = [(fn, rank, port, world_size) for rank in range(world_size)]
        done = pool.starmap_async(_rank_main, jobs).get(timeout=timeout)
    for rank, (_, output) in enumerate(done):
        for line in output.splitlines():
            print(f"rank {rank} printed: {line}")
    return [result for result, _ in done]
