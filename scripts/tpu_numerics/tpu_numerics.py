"""Emulate a TPU's matmul numerics on XLA:CPU (repository tooling for the CI lane, not the toolkit).

XLA:CPU computes float32 matmuls and convolutions exactly. A TPU at torch_xla's default
matmul precision rounds the float32 INPUTS of every matmul/convolution to bfloat16 (one pass,
float32 accumulation); ``"high"`` is three bfloat16 passes (bf16_3x:
``a*b ~ ah*bh + ah*bl + al*bh`` with ``ah = bf16(a)``, ``al = bf16(a - ah)``), ``"highest"``
six passes, treated here as exact float32. Source: the ``torch_xla.backends.
set_mat_mul_precision`` docstring and upstream ``docs/source/tutorials/precision_tutorial``
(pytorch/xla v2.9.0).

:func:`install` pushes a ``TorchDispatchMode`` once, for good, on the calling thread. It sees
the matmul-like aten ops (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``dot``,
``convolution``, ``convolution_backward``; ``einsum``, ``linear`` and scaled-dot-product
attention decompose into them) and rounds their float32 multiplicands on the XLA device as the
precision read at each call (``torch_xla.backends.get_mat_mul_precision()``) says; additive
biases, CPU tensors and other dtypes are untouched. Autograd carries the mode to its threads,
so backward passes are rounded too; a forked child inherits it.

Proof it ran: every process that rounds at least once writes ``<pid>.json`` (``{"pid",
"count", "argv"}``) into ``$TPU_NUMERICS_DIR`` (when set) on its first rounded call, then
every 2 s of use and at exit (forked pool workers leave by ``os._exit``: their file is at most
2 s stale).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
_FLUSH_SECONDS = 2.0

# op -> (multiplicand positions, how later passes of "high" drop the additive bias)
_PLAIN = {_aten.mm.default, _aten.bmm.default, _aten.mv.default, _aten.dot.default}
_BETA = {_aten.addmm.default, _aten.baddbmm.default}            # self*beta + alpha*(m1 @ m2)
_CONV = {_aten.convolution.default, _aten._convolution.default}  # (input, weight, bias, ...)
_CONV_BACKWARD = _aten.convolution_backward.default
_OPS = frozenset(_PLAIN | _BETA | _CONV | {_CONV_BACKWARD})

_state = {"count": 0, "installed": False, "last_flush": 0.0, "pid": None}


def _precision() -> str:
    import torch_xla.backends
    return torch_xla.backends.get_mat_mul_precision()


def _eligible(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32
            and t.device.type == "xla")


def _unannotated(t: torch.Tensor) -> torch.Tensor:
    """Drop the SPMD sharding annotation torch_xla copies onto a cast from its input.

    A TPU rounds inside the dot: no convert op, nothing to annotate. Here the casts inherit
    their input's annotation, and torch_xla marks an unannotated input ``{replicated}`` after
    the first run, so step 2's graph would differ from step 1's: one extra compile that a TPU
    does not have. Unannotated, the partitioner propagates the input's sharding as before.

    Only a real XLA tensor has an annotation: ``scan_layers`` traces its layer with
    AOTAutograd on fake tensors whose device is ``xla`` (torch_xla/experimental/scan.py), and
    asking a fake tensor for its sharding crashes the process. The rounding casts are still
    traced into that graph, so the scanned layers round as the others do."""
    from torch._subclasses.fake_tensor import is_fake
    from torch_xla import _XLAC  # (this module is imported by processes without torch_xla)
    if not is_fake(t) and _XLAC._get_xla_sharding_spec(t):
        _XLAC._xla_clear_sharding(t)
    return t


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return _unannotated(_unannotated(t.to(torch.bfloat16)).to(torch.float32))


def _split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    high = _bf16(t)
    return high, _bf16(_unannotated(t - high))


def _positions(func) -> tuple[int, ...]:
    if func in _BETA:
        return (1, 2)
    if func is _CONV_BACKWARD:
        return (0, 1, 2)  # grad_output, input, weight
    return (0, 1)


def _with(args: tuple, positions: tuple[int, ...], values) -> list:
    out = list(args)
    for i, v in zip(positions, values, strict=True):
        out[i] = v
    return out


def _no_bias(func, args: list, kwargs: dict) -> tuple[list, dict]:
    """Arguments for the second and third pass of "high": the product only, no bias."""
    if func in _BETA:
        return args, {**kwargs, "beta": 0}
    if func in _CONV:
        args[2] = None
    return args, kwargs


def _add(a, b):
    if isinstance(a, tuple):
        return tuple(None if x is None else x + y for x, y in zip(a, b, strict=True))
    return a + b


def _conv_backward(func, args, kwargs, precision):
    """grad_input/grad_weight from rounded multiplicands; grad_bias (a plain sum) from the
    unrounded grad_output, as on a TPU."""
    mask = list(args[10])
    products = _with(args, (10,), ([mask[0], mask[1], False],))
    if precision == "default":
        g, x, w = (_bf16(args[i]) for i in (0, 1, 2))
        gi, gw, _ = func(*_with(products, (0, 1, 2), (g, x, w)), **kwargs)
    else:
        (gh, gl), (xh, xl), (wh, wl) = (_split(args[i]) for i in (0, 1, 2))
        gi, gw, _ = func(*_with(products, (0, 1, 2), (gh, xh, wh)), **kwargs)
        for trio in ((gh, xl, wl), (gl, xh, wh)):
            gi, gw = _add((gi, gw), func(*_with(products, (0, 1, 2), trio), **kwargs)[:2])
    gb = func(*_with(args, (10,), ([False, False, True],)), **kwargs)[2] if mask[2] else None
    return gi, gw, gb


def _rounded(func, args, kwargs, precision):
    if func is _CONV_BACKWARD:
        return _conv_backward(func, args, kwargs, precision)
    positions = _positions(func)
    if precision == "default":
        return func(*_with(args, positions, (_bf16(args[i]) for i in positions)), **kwargs)
    (ah, al), (bh, bl) = (_split(args[i]) for i in positions)
    out = func(*_with(args, positions, (ah, bh)), **kwargs)
    for pair in ((ah, bl), (al, bh)):
        later, later_kwargs = _no_bias(func, _with(args, positions, pair), kwargs)
        out = out + func(*later, **later_kwargs)
    return out


_FUNCTIONALIZE = torch._C.DispatchKey.Functionalize


def _as_without_the_mode(func, args, kwargs):
    """Run an op that makes an XLA tensor from no XLA tensor (a factory such as
    ``zeros(device=xla)``, a CPU->XLA copy) as if no mode were active. The dispatcher hands
    such ops to the mode BEFORE functionalization and runs ``__torch_dispatch__`` with the
    Functionalize key excluded; torch_xla then returns a bare XLA tensor (no
    ``FunctionalTensorWrapper``: the "lifted later" case of ``AtenFromXlaTensor``) that nothing
    lifts. Such tensors are not what a TPU run has: ``param.data = ...`` (``module.to('xla')``
    in FSDPv2) re-uploads them through the host as replicated, dropping their sharding. Ops on
    XLA tensors reach the mode already unwrapped by functionalization, which re-wraps their
    results: they keep the exclusion."""
    leaves = tree_leaves((args, kwargs))
    if (any(isinstance(a, torch.Tensor) and a.device.type == "xla" for a in leaves)
            or not any(isinstance(a, torch.device) and a.type == "xla" for a in leaves)):
        return func(*args, **kwargs)  # on XLA tensors (see above), or not about XLA at all
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(_FUNCTIONALIZE)
    torch._C._dispatch_tls_set_dispatch_key_excluded(_FUNCTIONALIZE, False)
    try:
        return func(*args, **kwargs)
    finally:
        torch._C._dispatch_tls_set_dispatch_key_excluded(_FUNCTIONALIZE, excluded)


class TpuNumericsMode(TorchDispatchMode):
    """Round the float32 multiplicands of XLA matmuls/convolutions like a TPU would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _OPS:
            return _as_without_the_mode(func, args, kwargs)
        if not all(_eligible(args[i]) for i in _positions(func)):
            return func(*args, **kwargs)
        precision = _precision()
        if precision == "highest":
            return func(*args, **kwargs)
        out = _rounded(func, tuple(args), kwargs, precision)
        _counted()
        return out


class _SurveyMode(TpuNumericsMode):
    """``TPU_NUMERICS_OPS=1``: also count every aten op seen on an XLA tensor (to check that
    no matmul-like op escapes ``_OPS``); the names go into the proof file as ``"ops"``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_is_xla(a) for a in args):
            _ops[str(func)] = _ops.get(str(func), 0) + 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _is_xla(a) -> bool:
    return isinstance(a, torch.Tensor) and a.device.type == "xla"


_ops: dict[str, int] = {}


def _counted() -> None:
    _state["count"] += 1
    now = time.monotonic()
    if _state["count"] == 1 or now - _state["last_flush"] >= _FLUSH_SECONDS:
        _state["last_flush"] = now
        _flush()


def _flush() -> None:
    folder = os.environ.get("TPU_NUMERICS_DIR")
    if not folder or _state["count"] == 0:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{os.getpid()}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "count": _state["count"], "argv": sys.argv[:3],
                       **({"ops": _ops} if _ops else {})}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a proof file is best effort; never break the computation


def _after_fork_in_child() -> None:
    _state["count"] = 0
    _ops.clear()
    _state["last_flush"] = 0.0


def install() -> None:
    """Push the mode on this thread, once per process (forked children inherit it)."""
    if _state["installed"]:
        return
    import torch_xla.backends  # noqa: F401  (fail here, not at the first matmul)
    _state["installed"] = True
    mode = _SurveyMode if os.environ.get("TPU_NUMERICS_OPS") == "1" else TpuNumericsMode
    # Keep a Python reference to every pushed mode: the dispatch stack's own reference is
    # handed over when code pops the modes for a while (torch's _disable_current_modes, e.g. in
    # the preserve_rng_state of scan_layers' AOTAutograd trace), and a mode no one else holds
    # is freed before it is pushed back: a segfault.
    _state["modes"] = [mode()]
    _state["modes"][0].__enter__()  # never exited: active for the life of the process
    _in_every_thread(mode)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    atexit.register(_flush)


def _in_every_thread(mode: type) -> None:
    """The mode stack is per thread, and torch_xla.launch runs the replica function in a
    thread of its own (``_run_thread_per_device`` in ``_internal/pjrt.py``, v2.9.0): push the
    mode at the start of every thread started later (pool workers, loader threads)."""
    bootstrap = threading.Thread._bootstrap_inner

    def _bootstrap_inner(self):
        if not _get_current_dispatch_mode_stack():
            _state["modes"].append(mode())
            _state["modes"][-1].__enter__()
        return bootstrap(self)

    threading.Thread._bootstrap_inner = _bootstrap_inner


def active() -> bool:
    """Whether the emulation is installed in this process."""
    return _state["installed"]


def count() -> int:
    """How many matmul-like calls this process has rounded so far."""
    return _state["count"]


def counts(folder: str) -> dict[int, int]:
    """``{pid: count}`` from the proof files in ``folder`` (``$TPU_NUMERICS_DIR``)."""
    found = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
            found[data["pid"]] = data["count"]
    return found
