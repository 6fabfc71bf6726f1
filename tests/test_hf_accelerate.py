"""Notebook 12, sections 1 and 2: accelerate 1.15.0 on XLA with a real ``Accelerator``, real
launchers and real processes (XLA:CPU). The training script is the notebook's own ``%%writefile``
cell; the Trainer on every chip is the notebook's own function, run on one device under
``notebook_launcher``, over 8 virtual devices under SPMD and in 8 real processes over gloo."""

from __future__ import annotations

import ast
import inspect
import json
import os
import socket
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
from conftest import run_python, run_script  # noqa: E402

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
    """The notebook's script in a folder: cell nb12-acc-02 (``%%writefile``) and the cells that
    append to it (``%%writefile -a``), in order, without their magic lines."""
    path = tmp_path_factory.mktemp("acc")
    assert cell("nb12-acc-02").startswith("%%writefile {RUN_DIR}/acc_gpt2.py\n")
    (path / "acc_gpt2.py").write_text(acc_script())
    return path


def acc_script() -> str:
    """The script the notebook writes with %%writefile (and %%writefile -a), in order."""
    nb = json.loads(NOTEBOOK.read_text())
    parts = ["".join(c["source"]).partition("\n") for c in nb["cells"] if c["cell_type"] == "code"]
    return "\n".join(body for head, _, body in parts if head.startswith("%%writefile")
                     and head.endswith("/acc_gpt2.py")) + "\n"


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


# ------------------------------------------------------------ the Trainer on every chip (section 2)

#: Section 2's cells: the imports, ``labelled``, ``build_trainer``, ``report`` and
#: ``train_and_predict``.
EVERY_CHIP_CELLS = ("nb12-all-01", "nb12-all-labelled", "nb12-all-02", "nb12-all-report",
                    "nb12-all-05")


def every_chip_source() -> str:
    return "\n\n".join(cell(c) for c in EVERY_CHIP_CELLS) + "\n"


def spmd_trainer_source() -> str:
    """Section 3's ``SpmdTrainer`` class, as the notebook's script defines it."""
    source = cell("nb12-fsdp-08")
    node = next(n for n in ast.parse(source.partition("\n")[2]).body
                if isinstance(n, ast.ClassDef) and n.name == "SpmdTrainer")
    return ast.get_source_segment(source.partition("\n")[2], node) + "\n"


def _report(path: Path, world: int, given: int = 45) -> dict:
    report = json.loads(path.read_text())
    padded = -(-given // (8 * world)) * 8 * world  # per-replica batch 8 times the world size
    assert report["world_size"] == world and report["given"] == given
    assert report["padded"] == report["returned"] == padded and report["in_order"] is True
    return report


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict:
    """The notebook's function under ``notebook_launcher`` without the Colab/Kaggle variables:
    ``num_processes=1`` runs it in this process (launchers.py), on this XLA:CPU device."""
    folder = tmp_path_factory.mktemp("every-chip")
    out, cwd = folder / "one.json", os.getcwd()
    hidden = {k: os.environ.pop(k) for k in list(os.environ)
              if k.startswith("KAGGLE") or k == "TPU_NAME"}
    try:
        os.chdir(folder)  # the Trainer's output_dir ("out-12") goes here
        namespace = {"__name__": "every_chip"}
        exec(compile(every_chip_source(), "every_chip", "exec"), namespace)
        notebook_launcher(namespace["train_and_predict"], args=(str(out),), num_processes=1)
    finally:
        os.chdir(cwd)
        os.environ.update(hidden)
    return _report(out, world=1)


@pytest.mark.one_line  # notebook 12 runs this launch and its checks on 2.8 too (platform run)
def test_trainer_on_every_chip_at_world_size_1_under_notebook_launcher(one_device):
    assert one_device["token_loss"] > 0  # 45 rows padded to 48: every row once, in order


SPMD_EVERY_CHIP = """
from tpu_helpers.env import configure_emulation

configure_emulation(num_devices=8)
import sys
import torch_xla
import torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
from transformers.integrations.tpu import tpu_spmd_dataloader
from tpu_helpers.spmd import device_mesh

xr.use_spmd()
xs.set_global_mesh(device_mesh(("fsdp",)))  # 8 devices on 'fsdp'; the model stays whole
# CELLS
# SPMD_TRAINER
Trainer = SpmdTrainer  # build_trainer builds the notebook's SpmdTrainer: data parallel
train_and_predict(sys.argv[1] + "/spmd.json")
tok = byte_tokenizer()
probe = build_trainer(tok, speeches(MAX_LEN))
batch = next(iter(probe.get_test_dataloader([labelled(tok, t) for t in speeches(MAX_LEN)[:8]])))
with open(sys.argv[1] + "/probe.json", "w") as f:
    json.dump(dict(sharding=torch_xla._XLAC._get_xla_sharding_spec(batch["input_ids"]),
                   devices=xr.global_runtime_device_count(), processes=xr.world_size()), f)
"""


@pytest.mark.one_line  # the SPMD Trainer runs on 2.8 in test_hf_fsdp.py and notebook 12, section 3
def test_trainer_on_every_chip_over_8_virtual_devices_under_spmd(tmp_path, one_device):
    """One SPMD process, 8 virtual devices: section 3's SpmdTrainer (its three loaders through
    transformers' tpu_spmd_dataloader, the model replicated) trains data-parallel and predicts
    every row once, in order; each batch of 8 rows is split one row per device, and the loss
    is one device's (the same global batches)."""
    code = SPMD_EVERY_CHIP.replace("# CELLS\n", every_chip_source()).replace(
        "# SPMD_TRAINER\n", spmd_trainer_source())
    run_script(tmp_path, "spmd_every_chip.py", code, str(tmp_path), timeout=600)
    report = _report(tmp_path / "spmd.json", world=1)  # one process: args.world_size == 1
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["devices"] == 8 and probe["processes"] == 1
    assert probe["sharding"].startswith("{devices=[8,1]")
    assert report["token_loss"] == pytest.approx(one_device["token_loss"], rel=1e-5)


GLOO_EVERY_CHIP = """
import sys
# CELLS

def both(folder):  # the notebook's function, then the same Trainer on the rows unpadded
    train_and_predict(folder + "/gloo.json")
    tok, texts = byte_tokenizer(), speeches(MAX_LEN)
    trainer = build_trainer(tok, texts)
    trainer.args.dataloader_drop_last = False  # else 45 rows on 8 x 8 score none
    given = [labelled(tok, t) for t in texts[-EVAL_ROWS:]]
    out = trainer.predict(given)
    if trainer.is_world_process_zero():
        Path(folder + "/unpadded.json").write_text(json.dumps(dict(
            returned=len(out.label_ids),
            in_order=np.array_equal(out.label_ids, [g["labels"] for g in given]))))


notebook_launcher(both, args=(sys.argv[1],), num_processes=8, use_port=sys.argv[2])
"""


@pytest.mark.one_line  # runs no torch_xla (USE_TORCH_XLA=0): CPU tensors over gloo
def test_trainer_on_every_chip_in_8_gloo_processes(tmp_path, monkeypatch):
    """notebook_launcher(num_processes=8) without Colab/Kaggle: elastic_launch forks 8 real
    processes; with USE_TORCH_XLA=0 and ACCELERATE_USE_CPU=true accelerate joins them with gloo
    (MULTI_CPU). accelerate's BatchSamplerShard gives each rank 8 of the 64 padded rows and
    gather_for_metrics returns all 64, in order. Without MpDeviceLoader's thread the trim fires
    at the last batch, so the unpadded 45 come back once too (drop_last off)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("USE_TORCH_XLA", "0")  # transformers and accelerate leave torch_xla alone
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # the Trainer asks accelerate for MULTI_CPU
    code = GLOO_EVERY_CHIP.replace("# CELLS\n", every_chip_source())
    run_script(tmp_path, "gloo_every_chip.py", code, str(tmp_path), str(port), timeout=300)
    _report(tmp_path / "gloo.json", world=8)  # 45 rows padded to 64, 8 per rank
    assert json.loads((tmp_path / "unpadded.json").read_text()) == {"returned": 45,
                                                                    "in_order": True}
