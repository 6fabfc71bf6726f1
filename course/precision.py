"""How close an XLA result should be to CPU PyTorch's, on the runtime this runs on (course only).

Taught in ``notebooks/04_prediction_gathering.ipynb`` (section "Why a TPU differs from the
CPU by about 1e-2"); notebooks 00, 06 and 07 use :func:`cpu_tolerance` and link there.

On a TPU, fp32 matrix multiplications and convolutions run at torch_xla's matmul precision,
``torch_xla.backends.get_mat_mul_precision()``: ``"default"`` (one bfloat16 pass: the inputs
are rounded to 8 bits of mantissa), ``"high"`` (three bfloat16 passes) or ``"highest"`` (six
passes, fp32 accuracy, slowest); source: the ``set_mat_mul_precision`` docstring and upstream
``docs/source/tutorials/precision_tutorial`` (pytorch/xla v2.9.0).
``torch_xla.backends.set_mat_mul_precision("highest")`` before the process compiles anything
makes a TPU match the CPU to about 1e-6 (the setting is read at compile time; switching it back
and forth in one process is unreliable, as upstream's own test notes). XLA:CPU computes fp32 in
fp32 whatever the setting.

The ``"default"`` tolerance is measured under the TPU-numerics lane (``scripts/tpu_numerics``,
``make test-tpu-numerics``), which rounds the fp32 inputs of every XLA matmul/convolution to
bfloat16 as a TPU does: the course's trained CNNs' logits then differ from fp32 CPU PyTorch by
about 1e-2 on average and at most 4.4e-2 (notebook 04; 3.8e-2 in notebook 06), every argmax
equal; 0.1 is that maximum with a margin of about 2x. ``"high"`` and ``"highest"`` follow from
the formats (about 2^-16 and fp32); no run on a real TPU is recorded yet (see the README).
"""

from __future__ import annotations

import sys

import torch_xla.backends
import torch_xla.runtime as xr

#: Absolute/relative tolerance against fp32 CPU PyTorch per TPU matmul precision ("default":
#: measured under the TPU-numerics lane, with a margin; see the module docstring).
TPU_TOLERANCE = {"default": 1e-1, "high": 1e-4, "highest": 1e-5}
#: XLA:CPU (and any fp32 backend): the same kernels' rounding differences only.
FP32_TOLERANCE = 1e-5


def runtime() -> str:
    """``"TPU"``; ``"emulated TPU"`` (XLA:CPU under the repository's TPU-numerics lane,
    ``scripts/tpu_numerics``, which rounds matmul inputs as a TPU does); or ``"XLA:<device>"``."""
    device = xr.device_type()  # the device the runtime actually uses
    if device == "TPU":
        return "TPU"
    lane = sys.modules.get("tpu_numerics")  # only ever loaded by that lane
    if lane is not None and lane.active():
        return "emulated TPU"
    return f"XLA:{device}"


def cpu_tolerance() -> tuple[float, str]:
    """The tolerance for comparing with CPU PyTorch here, and one sentence saying why."""
    where = runtime()
    if where not in ("TPU", "emulated TPU"):
        return FP32_TOLERANCE, (f"{where} computes fp32 in fp32: only rounding order differs "
                                f"from CPU PyTorch, so {FP32_TOLERANCE:g}.")
    precision = torch_xla.backends.get_mat_mul_precision()
    tol = TPU_TOLERANCE[precision]
    return tol, (f"a TPU{' (emulated here)' if where != 'TPU' else ''} runs fp32 matmuls at "
                 f"precision {precision!r} (bfloat16 passes), so results differ from CPU "
                 f"PyTorch by up to {tol:g} (measured under the TPU-numerics lane); "
                 "set_mat_mul_precision('highest') brings them to fp32 accuracy.")
