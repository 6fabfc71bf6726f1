"""Lightning's own XLA code path on XLA:CPU: accelerator choice, fit, checkpoint, predict, re-run,
the training sampler with drop_last, and the Lightning internals and banners notebook 06
describes (probed here, not in the notebook).

Real Lightning 2.6, real torch_xla on the XLA:CPU device (one device, set in conftest).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_script
from lightning import Trainer
from lightning.fabric.accelerators import xla as fabric_xla
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import XLAPrecision
from lightning.pytorch.strategies import SingleDeviceXLAStrategy
from torch.utils.data import DataLoader

from course.datasets import load_digits
from course.lightning_demo import (
    DigitsData,
    LitDigits,
    XLACountsCallback,
    XLACPUAccelerator,
    describe_choice,
    lightning_devices_table,
    lightning_processes,
    trainer_kwargs_here,
)
from tpu_helpers.data import ArrayDataset
from tpu_helpers.env import EnvironmentProblem, Runtime, layout_for
from tpu_helpers.lightning_writer import ExactlyOncePredictionWriter, read_predictions
from tpu_helpers.tpu_lightning import AtomicXLACheckpointIO, trainer_kwargs

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
V5E_8 = Runtime(platform="kaggle", tpu_generation="v5e", chips=8, layout=layout_for("v5e", 8))


# --------------------------------------------------------------------------- choice


def test_toolkit_trainer_kwargs_is_lightnings_tpu_accelerator_plus_atomic_checkpoints():
    for devices in ("auto", 1, 8, [3], "8"):
        kw = trainer_kwargs(devices)
        assert kw["accelerator"] == "tpu" and kw["devices"] == devices
        assert [type(p) for p in kw["plugins"]] == [AtomicXLACheckpointIO]
    cpu = XLACPUAccelerator()
    assert trainer_kwargs(1, accelerator=cpu)["accelerator"] is cpu


def test_course_trainer_kwargs_pick_the_xla_cpu_accelerator_here():
    kw = trainer_kwargs_here()
    assert isinstance(kw["accelerator"], XLACPUAccelerator)
    assert kw["devices"] == 1
    assert [type(p) for p in kw["plugins"]] == [AtomicXLACheckpointIO]
    assert "(SingleDeviceXLAStrategy) on the XLA:CPU device" in describe_choice(kw)
    assert lightning_processes("auto") == 1


def test_course_trainer_kwargs_on_a_tpu_are_the_toolkits():
    for devices in ("auto", 1, 8, [3]):
        kw = trainer_kwargs_here(devices, runtime=V5E_8)
        assert kw["accelerator"] == "tpu" and kw["devices"] == devices
    assert "Trainer(accelerator='tpu', devices=8)" in describe_choice(
        trainer_kwargs_here(8, runtime=V5E_8), runtime=V5E_8)
    assert [lightning_processes(d, V5E_8) for d in ("auto", 8, 1, [2])] == [8, 8, 1, 1]
    v3 = Runtime(platform="tpu-vm", tpu_generation="v3", chips=4, layout=layout_for("v3", 4))
    assert lightning_processes("auto", v3) == 4  # 4 processes x 2 threads


@pytest.mark.parametrize("devices", ["auto", 1, "1", [0]])
def test_xla_cpu_accepts_one_device(devices):
    assert XLACPUAccelerator.parse_devices(devices) in (1, [0])


@pytest.mark.parametrize("devices", [8, 2, [1], "2"])
def test_xla_cpu_refuses_several_devices_with_the_reason(devices):
    with pytest.raises(ValueError, match="pytorch/xla issue 9089"):
        trainer_kwargs_here(devices)


@pytest.mark.parametrize("devices", [0, -1, [0, 1], "x", None, 1.5, True])
def test_devices_lightning_would_refuse_fail_before_the_trainer(devices):
    with pytest.raises(ValueError, match="Lightning 2.6 on TPU takes"):
        trainer_kwargs(devices)


def test_the_removed_tpu_arguments_are_refused():
    """Notebook 06, section 1 prints these errors: ``tpu_cores`` and ``"tpu_spawn"`` are gone."""
    with pytest.raises(TypeError, match="tpu_cores"):
        Trainer(**{"tpu_cores": 8})
    with pytest.raises(ValueError, match="invalid strategy name"):
        Trainer(strategy="tpu_spawn")


def test_a_bad_loss_logging_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'epoch', 'logger' or 'prog_bar', not 'step'"):
        LitDigits(loss_logging="step")


def test_without_pjrt_cpu_the_fix_is_named(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(EnvironmentProblem, match="configure_emulation"):
        trainer_kwargs_here(runtime=Runtime(platform="local"))


def test_devices_table_matches_lightnings_own_rule(monkeypatch):
    """For each TPU, Lightning's device check accepts exactly what the table says."""
    table = lightning_devices_table()
    for tpu, row in table.iterrows():
        n = int(row['devices="auto"'])
        monkeypatch.setattr(fabric_xla.XLAAccelerator, "auto_device_count",
                            staticmethod(lambda n=n: n))
        accepted = set()
        for candidate in [1, 2, 4, 8, [0], [n - 1], [n]]:
            try:
                fabric_xla._check_tpu_devices_valid(candidate)
                accepted.add(str(candidate))
            except ValueError:
                pass
        assert accepted == {"1", str(n), "[0]", f"[{n - 1}]"}, tpu
        assert row["accepted devices"] == ("1, [i]" if n == 1 else
                                           f"1, {n}, [0]..[{n - 1}]"), tpu
    assert table.loc["v2-8 / v3-8", 'devices="auto"'] == 8
    assert table.loc["v4-8", 'devices="auto"'] == 4
    assert table.loc["v5e-1 (Colab)", 'devices="auto"'] == 1


# --------------------------------------------------------------------------- running


@pytest.fixture(scope="module")
def digits():
    train = ArrayDataset(*load_digits("train"))
    test = ArrayDataset(*load_digits("test"))
    return train, test


@pytest.fixture(scope="module")
def fitted(digits, tmp_path_factory):
    """Three short epochs through Lightning's XLA path, with a checkpoint callback."""
    train, test = digits
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = LitDigits(lr=5e-3)
    trainer, counts, checkpoint = make_trainer(ckpt_dir)
    trainer.fit(model, *loaders(train, test))
    return trainer, model, counts, checkpoint


def make_trainer(ckpt_dir):
    counts = XLACountsCallback()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_acc", mode="max")
    trainer = Trainer(**trainer_kwargs_here(), max_epochs=3, limit_train_batches=8,
                      callbacks=[counts, checkpoint], **QUIET)
    return trainer, counts, checkpoint


def loaders(train, test):
    return (DataLoader(train, batch_size=64, shuffle=True, drop_last=True),
            DataLoader(test, batch_size=120))


def test_fit_runs_lightnings_single_device_xla_strategy(fitted):
    trainer, model, counts, _ = fitted
    assert type(trainer.strategy) is SingleDeviceXLAStrategy
    assert str(trainer.strategy.root_device) == "xla:0"
    assert isinstance(trainer.precision_plugin, XLAPrecision)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicXLACheckpointIO)
    assert float(trainer.callback_metrics["val_acc"]) > 0.7
    epochs = counts.frame()
    assert list(epochs["steps"]) == [8, 8, 8]
    assert epochs["compiles"].iloc[0] >= 2  # first epoch: the step graphs are compiled
    # then at most one more graph: the first step of an epoch that starts with leftover
    # lazy work from the previous epoch's end (it depends on whether a checkpoint was saved)
    assert epochs["compiles"].iloc[1:].sum() <= 1
    # the loss is logged per epoch: no device-to-host transfer inside the steps
    assert counts.step_transfers_from_device and max(counts.step_transfers_from_device) == 0
    # one device: Lightning skips sync_dist (strategy.reduce is never called)
    assert (epochs["reduce_calls"] == 0).all()


def test_checkpoint_is_atomic_and_loads_into_a_fresh_module(fitted):
    _, model, _, checkpoint = fitted
    path = Path(checkpoint.best_model_path)
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir() if ".tmp" in p.name] == []
    restored = LitDigits.load_from_checkpoint(path, map_location="cpu")
    assert restored.hparams.lr == 5e-3
    raw = torch.load(path, map_location="cpu", weights_only=False)
    assert float(raw["callbacks"][next(k for k in raw["callbacks"]
                                       if k.startswith("ModelCheckpoint"))]["best_model_score"]
                 ) == pytest.approx(float(checkpoint.best_model_score))


def test_atomic_checkpoint_io_keeps_the_old_file_when_a_save_fails(tmp_path):
    io = AtomicXLACheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    with pytest.raises(Exception):  # noqa: B017  (pickling a lambda fails inside torch.save)
        io.save_checkpoint({"w": torch.zeros(3), "bad": lambda: 0}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_predict_with_the_writer_equals_a_plain_forward_pass(fitted, digits, tmp_path):
    _, model, _, _ = fitted
    _, test = digits
    writer = ExactlyOncePredictionWriter(tmp_path)
    trainer = Trainer(**trainer_kwargs_here(), callbacks=[writer], **QUIET)
    returned = trainer.predict(model, DataLoader(test, batch_size=100))
    assert len(returned) == 4  # one device: Lightning also returns them (not on 8 cores)
    merged = read_predictions(tmp_path)
    np.testing.assert_array_equal(merged.index, np.arange(len(test)))
    with torch.no_grad():
        plain = copy.deepcopy(model).cpu().eval()(torch.from_numpy(test.images))
    np.testing.assert_allclose(merged.values, plain.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(merged.values.argmax(1), plain.argmax(1).numpy())
    np.testing.assert_array_equal(writer.predictions.values, merged.values)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.json",
                                                          "rank00000-of-00001.npz"]


def test_refit_in_the_same_process_works_and_compiles_nothing_new(fitted, digits, tmp_path):
    from tpu_helpers.metrics import track

    trainer, model, _, _ = fitted
    # Lightning 2.6 trains a module left in eval mode as it is (only a warning): in a
    # notebook, after an eval-mode forward pass, call model.train() before fitting again
    assert model.training
    step = trainer.global_step
    # same Trainer: Lightning moves its stored metric state back to the device (two tiny
    # graphs), runs the sanity check, sees max_epochs reached and returns
    with track(max_compiles=2, what="same Trainer, fit again"):
        trainer.fit(model, *loaders(*digits))
    assert trainer.current_epoch == 3 and trainer.global_step == step
    # a new Trainer with the same settings: trains again, every graph comes from the cache
    again, counts, checkpoint = make_trainer(tmp_path)
    with track(max_compiles=0, what="new Trainer, same settings"):
        again.fit(model, *loaders(*digits))
    assert again.current_epoch == 3 and list(counts.frame()["steps"]) == [8, 8, 8]
    assert Path(checkpoint.best_model_path).parent == tmp_path


SYNC_DIST_SCRIPT = """
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from tpu_helpers.data import ArrayDataset
from course.datasets import load_digits
from course.lightning_demo import LitDigits


class CountReduceInSteps(L.Callback):
    # Counts strategy.reduce (what sync_dist=True calls) between a step's start and end.
    def __init__(self, mode):
        self.mode, self.in_step, self.calls, self.steps = mode, 0, 0, 0

    def setup(self, trainer, pl_module, stage):
        reduce = trainer.strategy.reduce

        def counted(*args, **kwargs):
            self.calls += self.in_step
            return reduce(*args, **kwargs)

        trainer.strategy.reduce = counted

    def on_train_batch_start(self, *args):
        self.in_step = 1

    def on_train_batch_end(self, *args):
        self.in_step = 0
        self.steps += 1

    def on_fit_end(self, trainer, pl_module):  # in each rank's process
        print(f"rank {trainer.global_rank} {self.mode}: {self.calls} reduce calls in "
              f"{self.steps} steps", flush=True)


if __name__ == "__main__":
    train = ArrayDataset(*load_digits("train"))
    for mode in ("prog_bar", "epoch"):
        counter = CountReduceInSteps(mode)
        # forked ranks, as XLAStrategy starts them on a TPU (no second interpreter to import)
        trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1,
                            strategy=DDPStrategy(start_method="fork",
                                                 process_group_backend="gloo"),
                            limit_train_batches=4, callbacks=[counter], logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        trainer.fit(LitDigits(loss_logging=mode),
                    DataLoader(train, batch_size=32, shuffle=True, drop_last=True))
"""


@pytest.mark.slow
def test_sync_dist_on_step_reduces_every_step_on_a_distributed_strategy(tmp_path, repo):
    """Real DDP (2 processes, gloo): the claim notebook 06 makes for XLAStrategy's mesh_reduce."""
    proc = run_script(tmp_path, "sync_dist_ddp.py", SYNC_DIST_SCRIPT)
    for rank in (0, 1):
        assert f"rank {rank} prog_bar: 4 reduce calls in 4 steps" in proc.stdout, proc.stdout
        assert f"rank {rank} epoch: 0 reduce calls in 4 steps" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- internals
# What notebook 06's "Lightning does / does not" table says about Lightning 2.6, probed here
# (not in the notebook) so that a Lightning upgrade fails a test, not a lesson.


def test_lightning_picks_its_samplers_for_several_devices():
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DistributedSampler

    loader = DataLoader(list(range(360)), batch_size=100)
    train = _get_distributed_sampler(loader, shuffle=True, overfit_batches=0,
                                     mode=RunningStage.TRAINING, num_replicas=8, rank=0)
    predict = _get_distributed_sampler(loader, shuffle=False, overfit_batches=0,
                                       mode=RunningStage.PREDICTING, num_replicas=8, rank=0)
    assert type(train) is DistributedSampler
    assert type(predict) is UnrepeatedDistributedSamplerWrapper


def test_forking_launchers_do_not_return_predictions():
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.strategies.launchers.xla import _XLALauncher
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    assert issubclass(_XLALauncher, _MultiProcessingLauncher)  # XLAStrategy forks like ddp_fork
    forking = Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", **QUIET)
    forking.predict_loop.return_predictions = None  # trainer.predict's default
    assert forking.predict_loop.return_predictions is False
    with pytest.raises(MisconfigurationException, match="return_predictions"):
        forking.predict_loop.return_predictions = True


def test_xla_strategy_wraps_loaders_in_mp_device_loader_only_on_several_devices():
    import torch_xla.distributed.parallel_loader as pl
    from lightning.pytorch.strategies import Strategy, XLAStrategy

    assert SingleDeviceXLAStrategy.process_dataloader is Strategy.process_dataloader
    strategy = XLAStrategy()
    strategy._launched = True  # as in a forked rank; here the one XLA:CPU device
    wrapped = strategy.process_dataloader(DataLoader(list(range(4)), batch_size=2))
    assert isinstance(wrapped, pl.MpDeviceLoader)


def test_xla_precision_and_strategy_internals_the_notebook_names():
    """Source canaries (tests only): names a Lightning upgrade may change."""
    import inspect

    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
    from lightning.pytorch.strategies import StrategyRegistry, XLAStrategy

    assert "reduce_gradients" in inspect.getsource(XLAPrecision)
    assert "broadcast_master_param" in inspect.getsource(XLAStrategy.setup)
    assert "mesh_reduce" in inspect.getsource(XLAStrategy.reduce)
    assert "xla" in StrategyRegistry and "xla_fsdp" not in StrategyRegistry
    assert "xla_fsdp" in FABRIC_STRATEGIES


def test_a_module_left_in_eval_mode_trains_as_it_is_with_a_warning(digits):
    train, _ = digits
    model = LitDigits().eval()
    trainer = Trainer(**trainer_kwargs_here(), max_epochs=1, limit_train_batches=1,
                      enable_checkpointing=False, **QUIET)
    with pytest.warns(UserWarning, match="eval mode"):
        trainer.fit(model, DataLoader(train, batch_size=32, drop_last=True))


def test_the_digits_data_module_trains_with_its_own_drop_last_sampler(digits):
    """Notebook 06, section 3: the LightningDataModule builds the training sampler itself
    (``DistributedSampler(drop_last=True)``); Lightning keeps it, calls its ``set_epoch`` and runs
    ``len(train) // 64`` batches per epoch on one device (8 processes: test_lightning_ddp)."""
    train, test = digits
    counts = XLACountsCallback()
    trainer = Trainer(**trainer_kwargs_here(), max_epochs=2, limit_train_batches=2,
                      limit_val_batches=0, callbacks=[counts], enable_checkpointing=False,
                      **QUIET)
    trainer.fit(LitDigits(), datamodule=DigitsData(train, test, 64, 120, seed=0))
    sampler = trainer.train_dataloader.sampler
    assert type(sampler) is torch.utils.data.DistributedSampler and sampler.drop_last
    assert sampler.epoch == 1  # Lightning called set_epoch for the second epoch
    assert len(trainer.train_dataloader) == len(train) // 64 == 22
    assert [(e["loader_batches"], e["sampler_drop_last"], e["steps"]) for e in counts.epochs] == [
        (22, True, 2), (22, True, 2)]


def test_lightning_keeps_a_loader_whose_sampler_is_already_distributed():
    """Source canary for notebook 06's drop_last lesson (Lightning 2.6,
    ``trainer/connectors/data_connector.py``): with several processes Lightning replaces a plain
    loader's sampler with its DistributedSampler (which pads by repeating) but returns a loader
    whose sampler already is a DistributedSampler unchanged."""
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DistributedSampler

    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", **QUIET)
    connector = trainer._data_connector
    data = list(range(37))
    plain = DataLoader(data, batch_size=4, shuffle=True, drop_last=True)
    own = DataLoader(data, batch_size=4, drop_last=True,
                     sampler=DistributedSampler(data, num_replicas=2, rank=0, drop_last=True))
    assert connector._requires_distributed_sampler(plain)
    assert not connector._requires_distributed_sampler(own)
    assert connector._prepare_dataloader(own, shuffle=True, mode=RunningStage.TRAINING) is own
    padded = DistributedSampler(data, num_replicas=2, rank=0)   # what Lightning would insert
    assert (len(padded), len(own.sampler)) == (19, 18)  # 37 rows: one repeated, or one dropped


def test_lightnings_banners_are_rank_zero_info_and_warning_level_hides_them(digits, tmp_path):
    """What notebook 06 keeps off its page: every Trainer logs at INFO through the logger
    ``lightning.pytorch.utilities.rank_zero`` (Lightning 2.6, ``trainer/setup.py``
    ``_log_device_info``: "TPU cores" there is ``trainer.num_devices``; the litlogger/litmodels
    tips; ``loops/fit_loop.py``'s "stopped" line). Setting that logger to WARNING, as the
    notebook does, drops them all."""
    import logging

    train, _ = digits
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    def fit_once(level):
        records.clear()
        handler, before = Keep(level=logging.DEBUG), logger.level
        logger.addHandler(handler)
        logger.setLevel(level)
        try:
            trainer = Trainer(**trainer_kwargs_here(), max_epochs=1, limit_train_batches=1,
                              default_root_dir=tmp_path, enable_progress_bar=False)
            trainer.fit(LitDigits(), DataLoader(train, batch_size=32, drop_last=True))
        finally:
            logger.removeHandler(handler)
            logger.setLevel(before)
        return [(r.levelno, r.getMessage()) for r in records]

    shown = fit_once(logging.INFO)
    messages = "\n".join(m for _, m in shown)
    assert "GPU available: False, used: False" in messages
    assert "TPU available: False, using: 1 TPU cores" in messages  # XLA:CPU, one device
    assert "litlogger" in messages and "litmodels" in messages
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in messages
    assert {level for level, _ in shown} == {logging.INFO}
    assert fit_once(logging.WARNING) == []
