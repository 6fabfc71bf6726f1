"""Notebook 11, section 7: accelerate 1.15.0 on XLA with a real ``Accelerator``, real launchers
and real processes (XLA:CPU). The training script is the notebook's own ``%%writefile`` cell."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
from accelerate import Accelerator, notebook_launcher  # noqa: E402
from accelerate.commands import launch  # noqa: E402
from accelerate.utils import patch_environment  # noqa: E402
from conftest import run_python  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "12_accelerate_and_fsdp_v2.ipynb"
#: Variables that make notebook_launcher take its Colab/Kaggle TPU branch (launchers.py).
KAGGLE_TPU = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_NAME": "local"}
QUIET = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no"]


def cell(cell_id: str) -> str:
    nb = json.loads(NOTEBOOK.read_text())
    return "".join(next(c["source"] for c in nb["cells"] if c.get("id") == cell_id))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The notebook's script (cell nb12-acc-02, without its ``%%writefile`` line) in a folder."""
    path = tmp_path_factory.mktemp("acc")
    first, body = cell("nb12-acc-02").split("\n", 1)
    assert first.startswith("%%writefile") and first.endswith("/acc_gpt2.py")
    (path / "acc_gpt2.py").write_text(body)
    return path


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE")}
    env.pop("TPU_NAME", None)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "PYTHONPATH": path, **extra}


def _trained(run: dict, steps: int) -> None:
    assert run["distributed_type"] == "DistributedType.XLA" and run["world_size"] == 1
    assert run["loader"] == "MpDeviceLoaderWrapper"
    assert len(run["losses"]) == steps and run["losses"][-1] < run["losses"][0]
    # one compile before AdamW has state, one with it, none after: fixed shapes
    assert run["compiles"][:2] == [1, 1] and sum(run["compiles"][2:]) == 0


def test_notebook_launcher_tpu_branch_forks_one_process_that_trains(folder):
    """Colab/Kaggle with TPU_NAME: xmp.spawn(PrepareForLaunch(fn, "XLA"), start_method="fork");
    on XLA:CPU that is one forked process (torch_xla run_multiprocess)."""
    code = ("import os; print('parent', os.getpid())\n"
            + cell("nb12-acc-04").split("\n", 1)[1])
    proc = subprocess.run([sys.executable, "-c", code], cwd=folder, env=_env(**KAGGLE_TPU),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Launching a training on TPU cores." in proc.stdout
    parent = int(proc.stdout.split("parent ", 1)[1].split()[0])
    run = json.loads((folder / "launcher.json").read_text())
    assert run["pid"] != parent and run["fork_launched"]  # a forked child, marked by accelerate
    _trained(run, steps=2 * 40 // 8)


def test_accelerate_launch_tpu_command_spawns_a_process_that_trains(folder):
    """The command section 7 prints: tpu_launcher, xmp.spawn(PrepareForLaunch(main)), spawn."""
    block = cell("nb12-acc-06").split("```")[1]
    words = block.replace("\\\n", " ").split()
    assert words[:2] == ["accelerate", "launch"]
    assert words[-3:] == ["acc_gpt2.py", "2", "script.json"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *words[2:]]
    proc = subprocess.Popen(cmd, cwd=folder, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "were not passed to `accelerate launch`" not in out  # the flags silence the warnings
    run = json.loads((folder / "script.json").read_text())
    assert run["pid"] != proc.pid and run["fork_launched"]  # PrepareForLaunch marks it, spawn too
    _trained(run, steps=2 * 40 // 8)


def test_tpu_launcher_ignores_num_processes_and_spawns():
    source = inspect.getsource(launch.tpu_launcher)
    assert "xmp.spawn(PrepareForLaunch(main_function), args=())" in source  # no nprocs
    assert "start_method" not in source  # torch_xla's default: spawn
    assert inspect.signature(torch_xla.distributed.xla_multiprocessing.spawn).parameters[
        "start_method"].default == "spawn"


def test_accelerate_launch_tpu_without_main_training_function_fails(folder):
    args = launch.launch_command_parser().parse_args(["--tpu", *QUIET, str(folder / "acc_gpt2.py")])
    assert args.main_training_function is None  # no config file: nothing names the function
    with pytest.raises(TypeError, match="attribute name must be string"):
        launch.launch_command(args)


def test_tpu_cluster_fails_importing_xla_dist(folder):
    args = launch.launch_command_parser().parse_args(
        ["--tpu", "--tpu_cluster", "--main_training_function", "main", *QUIET,
         str(folder / "acc_gpt2.py")])
    with pytest.raises(ImportError, match="xla_dist"):
        launch.launch_command(args)
    lines, _ = inspect.getsourcelines(launch.tpu_pod_launcher)
    assert lines[1].strip() == "from torch_xla.distributed import xla_dist"


def test_bf16_launch_sets_xla_use_bf16_only_on_a_tpu():
    from accelerate.utils import launch as launch_utils

    source = inspect.getsource(launch_utils.prepare_tpu)
    assert 'args.mixed_precision == "bf16" and is_torch_xla_available(check_is_tpu=True)' in source
    assert 'current_env["XLA_USE_BF16"] = "1"' in source


def test_notebook_launcher_here_needs_num_processes_and_runs_in_this_process(monkeypatch, capsys):
    for key in [k for k in os.environ if k.startswith("KAGGLE")] + ["TPU_NAME"]:
        monkeypatch.delenv(key, raising=False)
    pids = []
    with pytest.raises(ValueError, match="num_processes"):
        notebook_launcher(lambda: pids.append(os.getpid()))
    notebook_launcher(lambda: pids.append(os.getpid()), num_processes=1)
    assert pids == [os.getpid()] and "Launching training on CPU." in capsys.readouterr().out


def test_notebook_launcher_tpu_branch_refuses_an_existing_accelerator():
    Accelerator()
    with patch_environment(**KAGGLE_TPU), pytest.raises(ValueError, match="inside your training"):
        notebook_launcher(lambda: None)


FORK_AFTER_USE = """
import torch, torch_xla
from accelerate import notebook_launcher
torch_xla.sync(); (torch.ones(2, device=torch_xla.device()) * 2).cpu()  # the device is used
try:
    notebook_launcher(print, args=("never",))
except RuntimeError as err:
    print("RuntimeError:", err)
"""


def test_notebook_launcher_tpu_branch_refuses_after_the_device_was_used():
    proc = run_python(FORK_AFTER_USE, env=_env(**KAGGLE_TPU), timeout=300)
    assert "RuntimeError: Runtime is already initialized" in proc.stdout, proc.stdout


def test_prepare_wraps_the_loader_and_the_optimizer_step_all_reduces(monkeypatch):
    from accelerate import optimizer as acc_optimizer

    acc = Accelerator()
    assert str(acc.distributed_type) == "DistributedType.XLA"
    model = torch.nn.Linear(4, 1)
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4, drop_last=True)
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    assert isinstance(loader, pl.MpDeviceLoader)
    calls, real = [], acc_optimizer.xm.all_reduce
    monkeypatch.setattr(acc_optimizer.xm, "all_reduce",
                        lambda op, ts, scale=1.0, **kw: calls.append((op, len(ts), scale))
                        or real(op, ts, scale=scale, **kw))
    for x in loader:
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    assert calls == [("sum", 2, 1.0)] * 2  # weight and bias, scale 1 / world size, every step


def test_prepare_model_wraps_in_mp_model_wrapper_when_launched():
    source = inspect.getsource(Accelerator.prepare_model)
    assert ("elif self.distributed_type == DistributedType.XLA and self.state.fork_launched:\n"
            "                model = xmp.MpModelWrapper(model).to(self.device)") in source
