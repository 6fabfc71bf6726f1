"""When a replica hangs: say which one, where, and stop.

Each replica ticks its progress, ``tick(step, phase)``, into a small memory-mapped file in a
folder the replicas share: about a microsecond on the host, no device read, no collective. A
:class:`Monitor` (a thread in the launching process: ``tpu_helpers.launch``; or one per replica
where nothing else launches, :func:`start`) reads every replica's file. When a replica that has
finished its warm-up steps has not advanced for longer than the timeout (derived from the
measured step time; paused while its compile count grows), it asks every replica for its Python
stack (``faulthandler`` on SIGUSR1), prints each replica's step, phase and the line it waits
in, names the replicas behind and ahead, and stops them (unless ``report_only``).

Copy this file alone: the standard library, plus torch_xla's public metrics for the compile
count. Importing it does not touch the XLA device.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import re
import signal
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("start", "data", "step", "collective", "checkpoint", "eval", "predict", "done")
_PHASE = {name: i for i, name in enumerate(PHASES)}
_HEAD = struct.Struct("<qqqqd")  # pid, first step ticked, step, phase, time (time.monotonic)
_COMPILES = struct.Struct("<q")  # at offset _HEAD.size, written by the replica's sampler
_SIZE = _HEAD.size + _COMPILES.size
ENV = "TPU_HELPERS_WATCHDOG"  #: the shared folder, set by the launcher for its replicas
SIGNAL = signal.SIGUSR1  #: asks a replica for its stack

_state: dict = {}  # this replica: "slot" (its mmap), "pid", "stack" (the dump file)
os.register_at_fork(after_in_child=_state.clear)  # a forked replica opens its own slot


class ReplicaHung(RuntimeError):
    """The watchdog stopped a run: no replica advanced for longer than the timeout."""


def _slot_path(folder: Path, rank: int) -> Path:
    return folder / f"replica-{rank:05d}.slot"


def start_replica(folder: str | os.PathLike[str], rank: int,
                  sample_every: float | None = 0.5) -> None:
    """Open this replica's slot in ``folder``, dump its stack there on SIGUSR1, and sample
    torch_xla's compile count every ``sample_every`` seconds, off the step path (None: a
    replica without XLA, e.g. a gloo process)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = _slot_path(folder, rank)
    with open(path, "wb") as f:
        f.write(bytes(_SIZE))
    fd = os.open(path, os.O_RDWR)
    slot = mmap.mmap(fd, _SIZE)
    os.close(fd)
    stack = open(folder / f"replica-{rank:05d}.stack", "w")  # noqa: SIM115 (open for life)
    # the thread that ticks (torch_xla.launch runs the replica in a thread of its process)
    (folder / f"replica-{rank:05d}.thread").write_text(f"{threading.get_ident():#018x}")
    faulthandler.register(SIGNAL, file=stack, all_threads=True)
    _state.update(slot=slot, pid=os.getpid(), stack=stack, first=None)
    _HEAD.pack_into(slot, 0, os.getpid(), -1, -1, 0, time.monotonic())
    if sample_every is not None:
        threading.Thread(target=_sample_compiles, args=(slot, sample_every), daemon=True).start()


def _sample_compiles(slot: mmap.mmap, every: float) -> None:
    import torch_xla.debug.metrics as met  # deferred: importing this module imports no torch_xla

    while True:
        _COMPILES.pack_into(slot, _HEAD.size, int((met.metric_data("CompileTime") or (0,))[0]))
        time.sleep(every)


def tick(step: int | None = None, phase: str = "step") -> None:
    """Record this replica's progress: ``step`` (optimizer steps done, or the batch being
    predicted; None: the last one) and ``phase`` (one of :data:`PHASES`). A no-op without a
    watchdog; with the launcher's folder in the environment, the first tick opens the slot."""
    slot = _state.get("slot")
    if slot is None:
        folder = os.environ.get(ENV)
        if not folder:
            return
        import torch_xla.runtime as xr  # deferred, as above

        start_replica(folder, xr.global_ordinal())
        slot = _state["slot"]
    step = _state.get("step", 0) if step is None else step
    if _state["first"] is None:  # warm-up is counted from here (a resumed run starts late)
        _state["first"] = step
    _state["step"] = step
    _HEAD.pack_into(slot, 0, _state["pid"], _state["first"], step, _PHASE[phase],
                    time.monotonic())


@dataclass
class _Seen:
    """What the monitor knows of one replica."""
    pid: int = 0
    step: int = -1
    phase: str = "start"
    since: float = 0.0  # monotonic time of its last progress (a tick or a compile)
    step_at: float = 0.0  # when its step counter last moved
    compiles: int = 0
    first: int = -1  # the first step it ticked (-1: none yet; a resumed run starts late)
    intervals: list[float] = field(default_factory=list)  # seconds per step, recent


@dataclass
class Monitor:
    """Watches ``world`` replicas' slots in ``folder``. The timeout is ``timeout`` if given,
    else ``factor`` x the median step interval, at least ``min_timeout`` seconds; a replica is
    judged only after ``warmup`` steps (first compiles), and a grown compile count counts as
    progress. :meth:`poll` returns the report when it fires."""

    folder: Path
    world: int | None = None  # None: every replica that has opened a slot in the folder
    timeout: float | None = None
    min_timeout: float = 120.0
    factor: float = 20.0
    warmup: int = 3
    seen: dict[int, _Seen] = field(default_factory=dict)
    fired: bool = False
    done: bool = False  # set by the launcher when the run ends: the watching thread returns
    last_report: str = ""

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)

    def _read(self, rank: int, now: float) -> _Seen:
        s = self.seen.setdefault(rank, _Seen(since=now))
        try:
            raw = _slot_path(self.folder, rank).read_bytes()
        except FileNotFoundError:
            return s
        if len(raw) < _SIZE:
            return s
        pid, s.first, step, phase, at = _HEAD.unpack_from(raw)
        (compiles,) = _COMPILES.unpack_from(raw, _HEAD.size)
        if step != s.step:
            if self._armed(s) and step > s.step:
                s.intervals = (s.intervals + [(at - s.step_at) / (step - s.step)])[-50:]
            s.step_at = at
        s.since = max(at, s.since)  # any tick is progress (an evaluation ticks per batch)
        if compiles != s.compiles:  # a compile finished: the wait was XLA, not a hang
            s.since = now
        s.pid, s.step, s.phase, s.compiles = pid, step, PHASES[phase], compiles
        return s

    def _armed(self, s: _Seen) -> bool:
        """Past its warm-up steps (the first compiles), so a long wait now is not a compile."""
        return s.first >= 0 and s.step - s.first >= self.warmup

    def limit(self) -> float:
        """The timeout now: given, or derived from the replicas' measured step times."""
        if self.timeout is not None:
            return self.timeout
        times = [t for s in self.seen.values() for t in s.intervals]
        return max(self.min_timeout, self.factor * statistics.median(times) if times else 0.0)

    def poll(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        ranks = (range(self.world) if self.world is not None else
                 sorted(int(p.name[8:13]) for p in self.folder.glob("replica-*.slot")))
        replicas = [self._read(r, now) for r in ranks]
        limit = self.limit()
        stuck = [r for r, s in enumerate(replicas)
                 if self._armed(s) and s.phase != "done" and now - s.since > limit]
        self.fired = self.fired or bool(stuck)
        if stuck:
            self.last_report = self.report(now, limit)
        return self.last_report if stuck else None

    def report(self, now: float, limit: float) -> str:
        """Every replica's step, phase, idle time and the line it waits in (its stack)."""
        stacks = self.stacks()
        rows = [f"tpu_helpers.hang_watchdog: no progress for longer than {limit:.1f} s",
                f"{'replica':>7}  {'step':>6}  {'phase':10}  {'idle':>7}  where it waits"]
        for r, s in sorted(self.seen.items()):
            rows.append(f"{r:>7}  {s.step:>6}  {s.phase:10}  {now - s.since:6.1f}s  "
                        f"{_where(stacks.get(r, ''))}")
        steps = {s.step for s in self.seen.values()}
        if len(steps) > 1:
            lo, hi = min(steps), max(steps)
            name = lambda k: ", ".join(str(r) for r, s in self.seen.items() if s.step == k)  # noqa: E731
            rows.append(f"behind: replica(s) {name(lo)} at step {lo}; "
                        f"ahead: replica(s) {name(hi)} at step {hi}")
        for r, text in sorted(stacks.items()):
            rows += [f"--- replica {r} (pid {self.seen[r].pid}): Python stack ---", text.strip()]
        return "\n".join(rows)

    def stacks(self, wait: float = 1.0) -> dict[int, str]:
        """Each live replica's stack (its ticking thread first), asked for with SIGUSR1."""
        asked = {}
        for r, s in self.seen.items():
            path = self.folder / f"replica-{r:05d}.stack"
            try:
                os.truncate(path, 0)
                os.kill(s.pid, SIGNAL)
                asked[r] = path
            except (OSError, ProcessLookupError):
                continue
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not all(p.stat().st_size for p in asked.values()):
            time.sleep(0.05)
        time.sleep(0.1)  # let the dump finish
        return {r: _main_thread(p.read_text(errors="replace"),
                                self.folder / f"replica-{r:05d}.thread") for r, p in asked.items()}

    def stop_replicas(self) -> None:
        for s in self.seen.values():
            if s.pid and s.pid != os.getpid():
                try:
                    os.kill(s.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _main_thread(dump: str, main_file: Path) -> str:
    """The ticking thread's part of a faulthandler dump first (the others follow it)."""
    try:
        ident = main_file.read_text().strip()
    except OSError:
        return dump
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    main = [b for b in blocks if ident in b.split("\n", 1)[0]]
    return "\n".join(main + [b for b in blocks if b not in main])


def _where(stack: str) -> str:
    """The innermost frame in the user's code (not the standard library or site-packages)."""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stack.split("\n\n")[0])
    lib = ("site-packages", "dist-packages", f"python{sys.version_info[0]}.")
    user = next(((f, n, fn) for f, n, fn in frames if not any(x in f for x in lib)), None)
    innermost = frames[0] if frames else None
    if user is None:
        return f"{innermost[0]}:{innermost[1]} in {innermost[2]}" if innermost else "(no stack)"
    inner = f" -> {innermost[2]}" if innermost and innermost != user else ""
    return f"{Path(user[0]).name}:{user[1]} in {user[2]}{inner}"


def watch(monitor: Monitor, *, poll: float = 0.5, report_only: bool = False,
          on_fire=None) -> threading.Thread:
    """Run ``monitor`` in a daemon thread; when it fires, print the report to stderr, then
    (unless ``report_only``) stop every replica and call ``on_fire(report)``."""
    def loop() -> None:
        while not monitor.done:
            time.sleep(poll)
            report = monitor.poll()
            if report:
                print(report, file=sys.stderr, flush=True)
                if not report_only:
                    if on_fire is not None:
                        on_fire(report)
                    monitor.stop_replicas()
                return

    thread = threading.Thread(target=loop, name="tpu_helpers.hang_watchdog", daemon=True)
    thread.start()
    return thread


def start(folder: str | os.PathLike[str], rank: int, world: int, **monitor_args) -> None:
    """Where nothing else launches (your own ``torch_xla.launch`` in a notebook): open this
    replica's slot, and on rank 0 a monitor thread over all ``world`` replicas."""
    start_replica(folder, rank)
    if rank == 0:  # it stops the others, then itself: the launch fails instead of waiting
        poll = monitor_args.pop("poll", 0.5)
        report_only = monitor_args.pop("report_only", False)
        watch(Monitor(Path(folder), world, **monitor_args), poll=poll, report_only=report_only,
              on_fire=lambda report: threading.Timer(1.0, os._exit, (3,)).start())
