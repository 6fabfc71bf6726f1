"""How close an XLA result should be to CPU PyTorch's, on the runtime this runs on (course only).

Taught in ``notebooks/04_prediction_gathering.ipynb`` (section "Why a TPU differs from the
CPU at about 1e-3"); notebooks 06 and 07 use :func:`cpu_tolerance` and link there.

On a TPU, fp32 matrix multiplications and convolutions run at torch_xla's matmul precision,
``torch_xla.backends.get_mat_mul_precision()``: ``"default"`` (one bfloat16 pass: 8 bits of
mantissa, so results differ from fp32 CPU PyTorch by about 1e-3 relative, up to 1e-2 after a
few layers), ``"high"`` (three bfloat16 passes, about 1e-5) or ``"highest"`` (six passes,
fp32 accuracy, slowest). ``torch_xla.backends.set_mat_mul_precision("highest")`` before the
process compiles anything makes a TPU match the CPU to about 1e-6 (the setting is read at
compile time; switching it back and forth in one process is unreliable, as upstream's own
test notes). XLA:CPU computes fp32 in fp32 whatever the setting. The TPU figures follow
from the formats; no TPU run of this repository is recorded yet (see the README), so they
are what a TPU should show, not what we measured.
"""

from __future__ import annotations

import torch_xla.backends
import torch_xla.runtime as xr

#: Absolute/relative tolerance against fp32 CPU PyTorch per TPU matmul precision.
TPU_TOLERANCE = {"default": 2e-2, "high": 1e-4, "highest": 1e-5}
#: XLA:CPU (and any fp32 backend): the same kernels' rounding differences only.
FP32_TOLERANCE = 1e-5


def cpu_tolerance() -> tuple[float, str]:
    """The tolerance for comparing with CPU PyTorch here, and one sentence saying why."""
    if xr.device_type() != "TPU":  # the device the runtime actually uses
        return FP32_TOLERANCE, ("XLA:CPU computes fp32 in fp32: only rounding order differs "
                                f"from CPU PyTorch, so {FP32_TOLERANCE:g}.")
    precision = torch_xla.backends.get_mat_mul_precision()
    tol = TPU_TOLERANCE[precision]
    return tol, (f"a TPU runs fp32 matmuls at precision {precision!r} (bfloat16 passes), so "
                 f"results differ from CPU PyTorch by up to about {tol:g}; "
                 "set_mat_mul_precision('highest') brings them to fp32 accuracy.")
