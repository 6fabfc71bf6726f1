"""A fresh Python for tests, started by fork from a process that imported torch but not
torch_xla (``run``: the ``subprocess.run`` of ``python -c CODE``, ``python -m MOD`` and
``python SCRIPT``).

Why: ``import torch_xla`` costs about 4 s of CPU here, and 2.9 s of it is torch,
``torch._dynamo`` and ``functorch.compile``, which it imports. The server imports those once per
test process; each child is forked from it, so it imports only the rest (about 1.1 s: not
``torch._inductor``, whose import makes every later fork a "bad fork" for CUDA, which Lightning
then refuses), with the child's own environment: torch_xla and everything it
reads at import (``XLA_*``, ``PJRT_*``, ``PT_XLA_*``, ``CPU_NUM_DEVICES``...) start in the child,
as in a fresh interpreter. The child gets the request's cwd, environment, ``sys.argv``,
``sys.path`` (script folder or cwd first, then the request's PYTHONPATH, then the venv's),
``__main__`` module, stdin from /dev/null and its own session; it ends as Python does (an
uncaught exception prints its traceback and exits 1; atexit handlers run).

What a fork cannot give is a process without torch already imported, or one whose start-up
reads other Python/torch variables: ``run`` starts a real fresh interpreter when the request
asks for it (``fresh=True``), when an environment variable that the interpreter or torch reads
at start-up differs from the server's (``PYTHON*`` but PYTHONPATH, ``TORCH*``, ``OMP_*``,
``MKL_*``, ``LD_*``), or when the server cannot start.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_STARTUP = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "LD_", "CUDA")
_LOCK = threading.Lock()
_SERVER: dict = {}


def _serve() -> None:  # the server process: preload, then fork one child per request
    import functorch.compile  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    assert "torch_xla" not in sys.modules, "the server must not import torch_xla"
    requests, replies = open(0, closefd=False), open(1, "w", closefd=False)  # the child
    # replaces fds 0-2: closing these objects there must not close its new files
    base_path = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    replies.write("ready\n")
    replies.flush()
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, base_path)  # never returns
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": status}) + "\n")
        replies.flush()


def _pythonpath(env) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _child(req: dict, base_path: list[str]) -> None:
    import runpy
    import types

    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a timed-out run shows its stacks
    for fd, new in ((0, os.open(os.devnull, os.O_RDONLY)), *(
            (fd, os.open(req[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            for fd, k in ((1, "out"), (2, "err")))):
        os.dup2(new, fd)
        os.close(new)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv, code = req["argv"], 0
    first = os.path.dirname(os.path.abspath(argv[0])) if argv[0] not in ("-c", "-m") else ""
    sys.path[:] = [first, *_pythonpath(req["env"]), *base_path]
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1 if req.get("unbuffered") else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        kind, exc, tb = sys.exc_info()  # the traceback starts at the code, as in python:
        sys.excepthook(kind, exc.with_traceback(tb.tb_next), tb.tb_next)
        code = 1
    sys.exit(code)  # leaves the server's loop: the interpreter's normal end (atexit, flush)


def _server():
    proc = _SERVER.get("proc")
    if proc is not None and proc.poll() is None:
        return proc
    if _SERVER.get("failed"):
        return None
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, "
                             f"{str(Path(__file__).parent)!r}); import zygote; zygote._serve()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).parent.parent)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        _SERVER["failed"] = True
        return None
    _SERVER.update(proc=proc, env=env)
    return proc


def _same_startup(env: dict) -> bool:
    """A fresh interpreter would start as the server did: the same start-up variables, and
    no sitecustomize (here or in a new PYTHONPATH entry) that it would run at start-up."""
    server = _SERVER["env"]
    keys = {k for k in (*env, *server) if k.startswith(_STARTUP) and k != "PYTHONPATH"}
    hooks = [p for p in _pythonpath(env) if p not in _pythonpath(server) and any(
        Path(p, f"{name}.py").exists() for name in ("sitecustomize", "usercustomize"))]
    return all(env.get(k) == server.get(k) for k in keys) and not hooks


def run(argv: list[str], *, env: dict | None = None, cwd=None, timeout: float | None = None,
        fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``, from
    the forking server unless ``fresh`` or the start-up environment differs (module doc)."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    with _LOCK:
        hooked = "sitecustomize" in sys.modules  # the lanes' start-up hook: fresh processes
        server = None if fresh or hooked else _server()
        if server is None or not _same_startup(env):
            return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, timeout=timeout,
                                  capture_output=True, text=True)
        with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
            out, err = f"{tmp}/out", f"{tmp}/err"
            server.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd, "out": out,
                                           "err": err, "unbuffered": bool(
                                               env.get("PYTHONUNBUFFERED"))}) + "\n")
            server.stdin.flush()
            pid = json.loads(server.stdout.readline())["pid"]
            ready, _, _ = select.select([server.stdout], [], [], timeout)
            if not ready:  # every process of the run (forked ranks too) prints its stacks
                os.killpg(pid, signal.SIGUSR2)  # to its stderr (fd 2: the err file), then ends
                time.sleep(3)
                os.killpg(pid, signal.SIGKILL)
            status = json.loads(server.stdout.readline())["status"]
            stdout, stderr = Path(out).read_text(errors="replace"), Path(err).read_text(
                errors="replace")
            if not ready:
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
    code = os.waitstatus_to_exitcode(status)
    return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)
