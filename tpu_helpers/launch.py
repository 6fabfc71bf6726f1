"""``torch_xla.launch`` that names the failing rank: :func:`launch` (any loop, no ``fit``).

Taught in notebook 03. Copy this file alone; importing it does not touch the XLA device. A
replica's exception, native crash or silent death (SIGKILL, os._exit) names the rank.
"""

from __future__ import annotations

import faulthandler
import functools
import itertools
import json
import os
import pickle
import re
import shutil
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch_xla

try:  # the hang watchdog (launch(..., watchdog=...)), inside the package or copied beside
    from . import hang_watchdog
except ImportError:
    try:
        import hang_watchdog  # type: ignore[no-redef]
    except ImportError:  # launch.py copied alone: no watchdog
        hang_watchdog = None


def _write(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all (the parent reads these files after a crash)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class ReplicaFailed(RuntimeError):
    """A replica of ``torch_xla.launch`` failed: which rank, what, and its traceback."""

    def __init__(self, rank: int | None, summary: str, details: str = "") -> None:
        self.rank, self.summary, self.details = rank, summary, details
        who = "a replica" if rank is None else f"rank {rank}"
        super().__init__(f"{who} failed: {summary}" + (f"\n\n{details}" if details else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across the process pool
        return (ReplicaFailed, (self.rank, self.summary, self.details))


class _Reported:
    """Per-replica wrapper: files say which rank started, failed or finished; each process
    dumps its Python stack on a crash (``rank-R.pid-P.crash``, R its first replica) and on
    SIGTERM (``.sigterm``: the pool stops the other workers with SIGTERM when one dies)."""

    _dumps: dict[int, tuple[Any, Any]] = {}  # per process (v2/v3: 2 replicas as threads)
    _lock = threading.Lock()

    def __init__(self, fn: Callable[..., Any], report_dir: str) -> None:
        self.fn, self.report_dir = fn, report_dir

    def _watch(self, folder: Path, rank: int) -> None:
        """Dump files first, then the marker: a rank that says it started can be judged."""
        with self._lock:
            if os.getpid() in self._dumps:
                return
            name = f"rank-{rank}.pid-{os.getpid()}"  # files open as long as the process:
            crash, term = (open(folder / f"{name}.{kind}", "w")  # noqa: SIM115
                           for kind in ("crash", "sigterm"))
            self._dumps[os.getpid()] = (crash, term)
            faulthandler.enable(file=crash, all_threads=True)
            # C-level handler: runs even while native code holds the GIL; chain=True then
            # lets SIGTERM end the process as before.
            faulthandler.register(signal.SIGTERM, file=term, all_threads=True, chain=True)

    def __call__(self, rank: int, *args: Any) -> Any:
        folder = Path(self.report_dir)
        self._watch(folder, rank)
        local = {"rank": rank, "pid": os.getpid(), "thread": threading.get_ident(),
                 "local": int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0")),
                 "count": int(os.environ.get("PJRT_LOCAL_PROCESS_COUNT", "1"))}
        _write(folder / f"rank-{rank}.started", json.dumps(local))
        try:
            result = self.fn(rank, *args)
        except BaseException as exc:
            details = traceback.format_exc()
            _write(folder / f"rank-{rank}.error", details)
            raise ReplicaFailed(rank, f"{type(exc).__name__}: {exc}", details) from None
        (folder / f"rank-{rank}.done").touch()
        return result


def _blame(folder: Path) -> ReplicaFailed:
    """Which replica broke the pool (the pool then SIGTERMs the others): the process with a
    crash dump; else the one that died without the pool's SIGTERM (SIGKILL, the out-of-memory
    killer, os._exit); else the local process that never started its replica."""
    procs: dict[int, dict[str, Any]] = {}
    for path in folder.glob("rank-*.started"):
        info = json.loads(path.read_text())
        proc = procs.setdefault(info["pid"], {**info, "ranks": [], "infos": []})
        proc["ranks"].append(info["rank"])
        proc["infos"].append(info)
    ended = {int(p.name.split(".")[0][len("rank-"):]) for p in
             itertools.chain(folder.glob("rank-*.done"), folder.glob("rank-*.error"))}

    def dump(pid: int, kind: str) -> str:
        return "".join(p.read_text() for p in folder.glob(f"rank-*.pid-{pid}.{kind}")).strip()

    def ranks(pid: int) -> str:
        return ", ".join(map(str, sorted(procs[pid]["ranks"])))

    crashed = sorted((_crashed_rank(p, procs), p.read_text().strip())
                     for p in folder.glob("rank-*.pid-*.crash") if p.stat().st_size)
    if crashed:  # written before the process died: the one sure sign
        also = "".join(f"; rank {rank} crashed too" for rank, _ in crashed[1:])
        return ReplicaFailed(crashed[0][0], "the process died without a Python exception (a "
                             f"crash in native code; the Python stack it dumped is below){also}",
                             crashed[0][1])
    silent = sorted((pid for pid, p in procs.items() if not dump(pid, "sigterm")
                     and not set(p["ranks"]) <= ended), key=lambda pid: procs[pid]["ranks"])
    count = max((p["count"] for p in procs.values()), default=0)
    unstarted = sorted(set(range(count)) - {p["local"] for p in procs.values()})
    if len(silent) == 1 and not unstarted:
        return ReplicaFailed(min(procs[silent[0]]["ranks"]), "the process died without a "
                             "Python exception and without a stack dump (SIGKILL, e.g. from "
                             "the out-of-memory killer, or os._exit); the pool then stopped "
                             "the other replicas with SIGTERM",
                             "(no Python stack was dumped: SIGKILL or os._exit)")
    if len(unstarted) == 1 and not silent:
        return ReplicaFailed(None, f"local process {unstarted[0]} of {count} died before "
                             "its replica started (its rank was not known yet)")
    return ReplicaFailed(None, "the process pool broke and the files do not say which "
                         "replica died first: no crash dump; died without the pool's "
                         f"SIGTERM: rank(s) {'; '.join(map(ranks, silent)) or 'none'}; "
                         f"never started: local process(es) {unstarted or 'none'}")


def _crashed_rank(dump: Path, procs: dict[int, dict[str, Any]]) -> int:
    """The rank whose thread crashed (v2/v3 run 2 replicas as threads of one process):
    faulthandler names the "Current thread"; else the process's first replica."""
    rank, pid = (int(part.split("-")[1]) for part in dump.name.split(".")[:2])
    current = re.search(r"Current thread (0x[0-9a-f]+)", dump.read_text())
    threads = {info["thread"]: info["rank"] for info in procs.get(pid, {}).get("infos", [])}
    return threads.get(int(current.group(1), 16), rank) if current else rank


class _Probe(pickle.Pickler):
    """Pickles into nothing; arrays and tensors are skipped (they pickle, and can be big)."""

    def __init__(self) -> None:
        super().__init__(self, protocol=pickle.HIGHEST_PROTOCOL)

    def write(self, data: bytes) -> int:  # the pickler's own output file
        return len(data)

    def persistent_id(self, obj: Any) -> int | None:
        return 0 if isinstance(obj, np.ndarray | torch.Tensor) else None


def _unpicklable(obj: Any, where: str, depth: int = 0) -> tuple[str, Any, Exception] | None:
    """The innermost part of ``obj`` that cannot be pickled: (its path, it, the error)."""
    try:
        _Probe().dump(obj)
        return None
    except Exception as exc:  # PicklingError, AttributeError, TypeError: all mean "cannot"
        error = exc
    parts: Any = ()
    if isinstance(obj, functools.partial):
        parts = [(f"{where}.func", obj.func), (f"{where}.args", obj.args)]
    elif isinstance(obj, list | tuple):
        parts = ((f"{where}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, dict):
        parts = ((f"{where}[{k!r}]", v) for k, v in obj.items())
    elif not callable(obj) and hasattr(obj, "__dict__"):
        parts = ((f"{where}.{k}", v) for k, v in vars(obj).items())
    for name, part in parts if depth < 6 else ():
        if found := _unpicklable(part, name, depth + 1):
            return found
    return where, obj, error


def check_picklable(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
    """Raise ``TypeError`` naming the part of ``fn``/``args`` that ``torch_xla.launch``
    could not send to its replicas, before any process starts."""
    found = _unpicklable(fn, "fn") or _unpicklable(tuple(args), "args")
    if found is None:
        return
    where, obj, error = found
    raise TypeError(
        f"launch cannot send {where} ({obj!r:.100}) to the replicas: {error}. "
        "torch_xla.launch pickles the function and its args for every replica process, "
        "even with start_method='fork' (fork only spares the replicas re-importing "
        "__main__): define the function at module level (a notebook's top-level cell is "
        "fine with fork; not a lambda, not inside another function) and pass data "
        "through `args`.")


def launch(fn: Callable[..., Any], args: tuple[Any, ...] = (), *,
           start_method: str = "fork", watchdog: bool | dict[str, Any] = False) -> None:
    """``torch_xla.launch``; checks first that ``fn`` and ``args`` pickle; a failure, even
    a native crash, raises :class:`ReplicaFailed` naming the rank, with its traceback (or
    the stack faulthandler dumped). ``watchdog`` (True, or ``hang_watchdog.Monitor``'s
    arguments plus ``poll``/``report_only``): replicas that stop ticking are named and
    stopped (``hang_watchdog.ReplicaHung``); needs ``hang_watchdog.py`` beside this file."""
    check_picklable(fn, args)
    report_dir = Path(tempfile.mkdtemp(prefix="tpu_helpers-launch-"))
    monitor, saved = None, os.environ.get(getattr(hang_watchdog, "ENV", ""), "")
    if watchdog:
        if hang_watchdog is None:
            raise ImportError("launch(watchdog=...) needs hang_watchdog.py beside launch.py")
        opts = {} if watchdog is True else dict(watchdog)
        watch = {k: opts.pop(k) for k in ("poll", "report_only") if k in opts}
        monitor = hang_watchdog.Monitor(report_dir / "watchdog", **opts)
        os.environ[hang_watchdog.ENV] = str(monitor.folder)  # replicas inherit it: each tick
        hang_watchdog.watch(monitor, **watch)                # writes to its slot there
    try:
        torch_xla.launch(_Reported(fn, str(report_dir)), args=args, start_method=start_method)
    except BrokenProcessPool as exc:
        if monitor is not None and monitor.fired:
            raise hang_watchdog.ReplicaHung(monitor.last_report) from None
        raise _blame(report_dir) from exc
    finally:
        if monitor is not None:
            monitor.done = True
            if saved:
                os.environ[hang_watchdog.ENV] = saved
            else:
                os.environ.pop(hang_watchdog.ENV, None)
        shutil.rmtree(report_dir, ignore_errors=True)
