"""course.host_memory with real forked processes: shared numpy pages are not copied."""

from __future__ import annotations

import numpy as np

from course.host_memory import forked_memory, touch_all

SIZE_MB = 32


def _build() -> np.ndarray:
    return np.ones((SIZE_MB * 1024 * 1024 // 4,), np.float32)


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_touch_all_reads_every_kind():
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert touch_all(a) == touch_all(a.tolist()) == touch_all(list(a)) == 15.0


def test_built_before_fork_is_shared_built_in_each_is_not():
    baseline = forked_memory(lambda: None, before_fork=True, processes=2)
    shared = forked_memory(_build, before_fork=True, processes=2)
    private = forked_memory(_build, before_fork=False, processes=2)
    assert len(shared) == len(private) == 2 and len({r["pid"] for r in shared}) == 2
    base = _mean(baseline, "uss_mb")
    # each worker that builds its own copy holds it privately (USS grows by ~32 MB) ...
    assert _mean(private, "uss_mb") - base > 0.8 * SIZE_MB
    # ... while reading an array built before fork copies (almost) nothing
    assert _mean(shared, "uss_mb") - base < 0.25 * SIZE_MB
    # and PSS splits the shared pages between the sharers
    assert _mean(private, "pss_mb") - _mean(shared, "pss_mb") > 0.25 * SIZE_MB


def test_a_failing_worker_fails_fast_not_hangs():
    import time

    import pytest

    def broken():
        raise OSError("disk on fire")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="disk on fire"):
        forked_memory(broken, before_fork=False, processes=2, timeout=60)
    assert time.monotonic() - start < 30
