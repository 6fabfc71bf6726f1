"""Course-only Lightning pieces for notebook 06: the digits LightningModule, a table of device
choices and a callback counting compiles and transfers."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from course.models import DigitsCNN
from tpu_helpers.env import Runtime, detect_runtime, layout_for
from tpu_helpers.lightning import LossLogging, XLACPUAccelerator


def describe_choice(kwargs: Mapping[str, Any], runtime: Runtime | None = None) -> str:
    """One sentence saying which accelerator :func:`trainer_kwargs` chose and why."""
    rt = runtime or detect_runtime()
    accel = kwargs["accelerator"]
    if isinstance(accel, XLACPUAccelerator):
        return (f"{rt.summary()}: Lightning runs its XLA code path (SingleDeviceXLAStrategy) "
                f"on the XLA:CPU device through {type(accel).__name__}, "
                f"devices={kwargs['devices']!r}.")
    return f"{rt.summary()}: Trainer(accelerator={accel!r}, devices={kwargs['devices']!r})."


def lightning_devices_table():
    """What ``Trainer(accelerator="tpu", devices=...)`` means per single-host TPU, as a DataFrame.

    ``devices="auto"`` is every XLA device on the host (chips x devices per chip, the
    world size of ``torch_xla.launch``); Lightning accepts only 1, that number, or ``[i]``.
    """
    import pandas as pd

    rows = []
    for accel, gen, chips in [("v2-8 / v3-8", "v3", 4), ("v4-8", "v4", 4),
                              ("v5e-1 (Colab)", "v5e", 1), ("v5e-8 (Kaggle)", "v5e", 8),
                              ("v5p-8", "v5p", 4), ("v6e-1 (Colab)", "v6e", 1),
                              ("v6e-8", "v6e", 8)]:
        lay = layout_for(gen, chips)
        n = lay.world_size
        many = (f"XLAStrategy: {lay.processes} processes x {lay.devices_per_process} "
                "threads" if lay.devices_per_process > 1 else
                f"XLAStrategy: {lay.processes} processes")
        rows.append({
            "TPU": accel,
            'devices="auto"': n,
            "accepted devices": "1, [i]" if n == 1 else f"1, {n}, [0]..[{n - 1}]",
            "devices=1 or [i]": "SingleDeviceXLAStrategy, 1 process",
            "devices=all": "same as 1" if n == 1 else many,
        })
    return pd.DataFrame(rows).set_index("TPU")


class DigitsLightningModule(L.LightningModule):
    """:class:`tpu_helpers.models.DigitsCNN` as a LightningModule (batches are ``(x, y, ...)``).

    ``loss_logging`` says how the training loss is logged:

    * ``"epoch"`` (default): ``on_step=False, on_epoch=True, sync_dist=True``: the loss is
      accumulated on the device and reduced once per epoch; no host sync per step.
    * ``"logger"``: also the per-step loss for the logger only (``prog_bar=False``, no
      ``sync_dist``): read every ``log_every_n_steps`` steps.
    * ``"prog_bar"``: the common ``on_step=True, prog_bar=True, sync_dist=True``: Lightning
      turns progress-bar values into Python floats after every step (a device-to-host
      transfer) and, on several TPU devices, ``sync_dist`` is an ``xm.mesh_reduce`` (a
      host round trip) at every ``self.log`` call.
    """

    def __init__(self, lr: float = 3e-3, weight_decay: float = 1e-4,
                 loss_logging: LossLogging = "epoch", width: int = 16) -> None:
        super().__init__()
        if loss_logging not in ("epoch", "logger", "prog_bar"):
            raise ValueError(f"loss_logging must be 'epoch', 'logger' or 'prog_bar', "
                             f"got {loss_logging!r}.")
        self.save_hyperparameters()
        self.model = DigitsCNN(width=width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        loss = F.cross_entropy(self(x), y)
        if self.hparams.loss_logging == "prog_bar":
            self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True,
                     sync_dist=True)
        else:
            self.log("train_loss", loss, on_step=False, on_epoch=True, prog_bar=True,
                     sync_dist=True)
            if self.hparams.loss_logging == "logger":
                self.log("train_loss_step", loss, on_step=True, on_epoch=False,
                         prog_bar=False, logger=True)
        return loss

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), prog_bar=True,
                 sync_dist=True)

    def predict_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                 weight_decay=self.hparams.weight_decay)


class XLACountsCallback(L.Callback):
    """Per epoch and per training step: what XLA did (:func:`tpu_helpers.metrics.snapshot`).

    ``epochs``: one dict per training epoch (validation inside it included) with the
    :class:`~tpu_helpers.metrics.Counts` fields, ``steps``, ``seconds``, ``train_seconds``
    (first step start to last step end, device work finished) and ``reduce_calls`` (calls
    of ``trainer.strategy.reduce``, which is what ``sync_dist=True`` does: one
    ``xm.mesh_reduce`` host round trip each with several TPU devices; always 0 on one
    device, where Lightning skips ``sync_dist``). ``step_transfers_from_device``: for each step
    but an epoch's last, the device-to-host transfers from its start to the next step's
    start (the progress bar and the logger included). :meth:`frame` gives ``epochs`` as
    a DataFrame.
    """

    def __init__(self) -> None:
        self.epochs: list[dict[str, Any]] = []
        self.step_transfers_from_device: list[int] = []

    # strategy.reduce is what sync_dist=True calls. Count it with a wrapper installed once
    # per strategy and never swapped back: Lightning stores the function in each logged
    # metric's metadata, and a different function on the next fit (same Trainer) would
    # fail its "self.log called twice with different arguments" check.
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        reduce = strategy.reduce
        if not hasattr(reduce, "calls"):
            def counted_reduce(*args: Any, **kwargs: Any) -> Any:
                counted_reduce.calls += 1  # type: ignore[attr-defined]
                return reduce(*args, **kwargs)

            counted_reduce.calls = 0  # type: ignore[attr-defined]
            strategy.reduce = counted_reduce  # type: ignore[method-assign]
        self._reduce = strategy.reduce

    @property
    def _reduce_calls(self) -> int:
        return int(getattr(getattr(self, "_reduce", None), "calls", 0))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from tpu_helpers.metrics import snapshot

        self._epoch_start = snapshot()
        self._epoch_time = time.perf_counter()
        self._epoch_reduce = self._reduce_calls
        self._steps = 0
        self._last_step: Any = None
        self._first_step_time: float | None = None
        self._last_step_time: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        from tpu_helpers.metrics import snapshot

        now = snapshot()
        if self._last_step is not None:
            self.step_transfers_from_device.append(
                now.transfers_from_device - self._last_step.transfers_from_device)
        self._last_step = now
        if self._first_step_time is None:
            self._first_step_time = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._steps += 1
        if batch_idx + 1 == trainer.num_training_batches:
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()
        self._last_step_time = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch_xla.core.xla_model as xm

        from tpu_helpers.metrics import snapshot

        xm.wait_device_ops()
        counts = snapshot() - self._epoch_start
        train_seconds = ((self._last_step_time or 0.0) - (self._first_step_time or 0.0))
        self.epochs.append({
            "epoch": trainer.current_epoch, "steps": self._steps,
            "seconds": time.perf_counter() - self._epoch_time,
            "train_seconds": train_seconds, **counts.as_dict(),
            "reduce_calls": self._reduce_calls - self._epoch_reduce,
        })

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.epochs).set_index("epoch")
