"""tpu_helpers.env: runtime detection, emulation, version checks, notebook setup.

Detection is tested on real files: fake sysfs trees written to tmp_path (the same layout
as /sys/bus/pci/devices) and explicit environment mappings. Anything that starts the XLA
runtime runs in a fresh subprocess, because the runtime is per process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_python

from tpu_helpers import env
from tpu_helpers.env import EnvironmentProblem, configure_emulation, detect_runtime


def fake_pci(root: Path, devices: list[tuple[str, str]]) -> Path:
    """Write a /sys/bus/pci/devices-like tree with (vendor, device) ids."""
    for i, (vendor, device) in enumerate(devices):
        d = root / f"0000:00:{i:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return root


@pytest.fixture
def no_kaggle(tmp_path: Path) -> Path:
    return tmp_path / "no-kaggle-here"


def test_local_machine_without_tpu(tmp_path, no_kaggle):
    pci = fake_pci(tmp_path / "pci", [("0x8086", "0x1237"), ("0x1af4", "0x1000")])
    rt = detect_runtime(environ={}, pci_root=pci, kaggle_dir=no_kaggle)
    assert rt.platform == "local" and not rt.has_tpu and rt.layout.world_size == 1
    assert "XLA:CPU emulation" in rt.summary()


@pytest.mark.parametrize(
    "device_id, chips, generation, world",
    [("0x0063", 8, "v5e", 8), ("0x0063", 1, "v5e", 1), ("0x005e", 4, "v4", 4),
     ("0x0027", 4, "v3", 8), ("0x006f", 1, "v6e", 1)],
)
def test_tpu_vm_from_pci(tmp_path, no_kaggle, device_id, chips, generation, world):
    pci = fake_pci(tmp_path / "pci", [("0x1ae0", device_id)] * chips + [("0x8086", "0x1237")])
    rt = detect_runtime(environ={}, pci_root=pci, kaggle_dir=no_kaggle)
    assert rt.platform == "tpu-vm"
    assert (rt.tpu_generation, rt.chips, rt.layout.world_size) == (generation, chips, world)


def test_colab_v5e1_and_kaggle_v5e8(tmp_path, no_kaggle):
    colab = detect_runtime(environ={"COLAB_RELEASE_TAG": "release-x",
                                    "TPU_ACCELERATOR_TYPE": "v5litepod-1"},
                           pci_root=fake_pci(tmp_path / "c", [("0x1ae0", "0x0063")]),
                           kaggle_dir=no_kaggle)
    assert colab.platform == "colab" and colab.tpu_generation == "v5e"
    assert colab.layout.world_size == 1
    kaggle = detect_runtime(environ={"KAGGLE_KERNEL_RUN_TYPE": "Interactive",
                                     "TPU_ACCELERATOR_TYPE": "v5litepod-8"},
                            pci_root=tmp_path / "empty", kaggle_dir=no_kaggle)
    assert kaggle.platform == "kaggle" and kaggle.layout.world_size == 8
    assert "world size 8" in kaggle.summary()


def test_kaggle_detected_by_its_folder(tmp_path):
    (tmp_path / "kaggle").mkdir()
    rt = detect_runtime(environ={}, pci_root=tmp_path / "none", kaggle_dir=tmp_path / "kaggle")
    assert rt.platform == "kaggle" and not rt.has_tpu


def test_unknown_environment_is_one_clear_sentence(tmp_path, no_kaggle):
    with pytest.raises(EnvironmentProblem, match="no TPU chip is attached.*unset PJRT_DEVICE"):
        detect_runtime(environ={"PJRT_DEVICE": "TPU"}, pci_root=tmp_path, kaggle_dir=no_kaggle)
    with pytest.raises(EnvironmentProblem, match="PJRT_DEVICE=CUDA is not supported"):
        detect_runtime(environ={"PJRT_DEVICE": "CUDA"}, pci_root=tmp_path, kaggle_dir=no_kaggle)
    with pytest.raises(EnvironmentProblem, match="Unknown TPU accelerator type 'tpu9-8'"):
        detect_runtime(environ={"TPU_ACCELERATOR_TYPE": "tpu9-8"}, pci_root=tmp_path,
                       kaggle_dir=no_kaggle)
    with pytest.raises(EnvironmentProblem, match="Unknown TPU generation 'v9'"):
        detect_runtime(environ={"TPU_ACCELERATOR_TYPE": "v9-8"}, pci_root=tmp_path,
                       kaggle_dir=no_kaggle)


def test_layout_table_generations():
    table = env.layout_table()
    assert table.loc["v3-8", "world size"] == 8
    assert table.loc["v4-8", "world size"] == 4
    assert table.loc["v5e-1 (Colab)", "world size"] == 1
    assert table.loc["v5e-8 (Kaggle)", "world size"] == 8


def test_configure_emulation_sets_cpu_devices(tmp_path, no_kaggle):
    environ: dict[str, str] = {}
    local = detect_runtime(environ={}, pci_root=tmp_path, kaggle_dir=no_kaggle)
    configure_emulation(4, environ=environ, runtime=local)
    assert environ["PJRT_DEVICE"] == "CPU" and environ["CPU_NUM_DEVICES"] == "4"
    configure_emulation(1, environ=environ, runtime=local)  # re-running changes the setting
    assert environ["CPU_NUM_DEVICES"] == "1"
    with pytest.raises(EnvironmentProblem, match="num_devices must be >= 1"):
        configure_emulation(0, environ=environ, runtime=local)


def test_configure_emulation_leaves_a_tpu_alone(tmp_path, no_kaggle):
    pci = fake_pci(tmp_path / "pci", [("0x1ae0", "0x0063")] * 8)
    tpu = detect_runtime(environ={}, pci_root=pci, kaggle_dir=no_kaggle)
    environ: dict[str, str] = {}
    configure_emulation(4, environ=environ, runtime=tpu)
    assert environ == {}


def test_runtime_already_initialised_is_refused_with_the_fix():
    proc = run_python(
        """
        import os
        os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
        from tpu_helpers.env import configure_emulation, runtime_initialized, EnvironmentProblem
        assert not runtime_initialized()
        import torch, torch_xla
        assert not runtime_initialized(), "importing torch_xla must not start the runtime"
        torch.ones(2, device=torch_xla.device())
        assert runtime_initialized()
        configure_emulation(1)  # same settings: fine
        try:
            configure_emulation(4)
        except EnvironmentProblem as exc:
            print("REFUSED:", exc)
        """
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED:")]
    assert line, proc.stdout + proc.stderr
    assert "already running" in line[0] and "restart the kernel" in line[0]
    assert "4 CPU device(s)" in line[0]


def test_versions_installed_here_match():
    assert env.version_problems(tpu=False) == []
    versions = env.check_versions(tpu=False)
    assert versions["torch"].split("+")[0] == versions["torch_xla"].split("+")[0] == "2.9.0"


def test_version_problems_name_the_fix(tmp_path):
    # A real mismatched environment: a venv-free site dir with fake dist-info metadata.
    site = tmp_path / "site"
    for name, version in [("torch", "2.8.0"), ("torch_xla", "2.9.0")]:
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    proc = run_python(
        f"""
        import sys
        sys.path.insert(0, {str(site)!r})
        from tpu_helpers import env
        for p in env.version_problems(tpu=True):
            print("PROBLEM:", p)
        """,
        env={"PYTHONNOUSERSITE": "1"},
    )
    problems = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBLEM:")]
    mismatch = [p for p in problems if "does not match" in p]
    assert mismatch and "torch 2.8.0 does not match torch_xla 2.9.0" in mismatch[0]
    assert "pip install torch==2.9.0 'torch_xla[tpu]==2.9.0'" in mismatch[0]
    assert any("libtpu is missing" in p for p in problems)


def test_missing_torch_xla_is_one_sentence(tmp_path):
    proc = run_python(
        """
        import importlib.metadata as md, sys
        real = md.version
        def version(name):
            if name == "torch_xla":
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = version  # hide the installed torch_xla from the metadata lookup
        from tpu_helpers import env
        print("PROBLEMS:", env.version_problems(tpu=False))
        """
    )
    fix = "torch_xla is not installed: run `pip install torch==2.9.0 torch_xla==2.9.0`"
    assert fix in proc.stdout


def test_pop_kaggle_launcher_vars_is_guarded():
    environ = {"TPU_PROCESS_ADDRESSES": "a:1", "OTHER": "x"}
    assert env.pop_kaggle_launcher_vars(environ) == ["TPU_PROCESS_ADDRESSES"]
    assert environ == {"OTHER": "x"}
    assert env.pop_kaggle_launcher_vars(environ) == []  # absent: no error


def test_setup_notebook_locally_installs_nothing():
    proc = run_python(
        """
        import subprocess, sys
        calls = []
        real_run = subprocess.run
        subprocess.run = lambda *a, **k: calls.append(a) or real_run(*a, **k)
        from tpu_helpers.env import setup_notebook
        rt = setup_notebook()
        rt2 = setup_notebook()  # idempotent
        print("CALLS", len(calls), rt.platform, rt == rt2, "torch" in sys.modules)
        """
    )
    assert "CALLS 0 local True False" in proc.stdout, proc.stdout
    assert "no TPU attached" in proc.stdout


def test_report_runs_as_a_command():
    proc = run_python("import runpy; runpy.run_module('tpu_helpers.env', run_name='__main__')")
    assert "torch_xla  2.9.0" in proc.stdout and "versions: OK" in proc.stdout
