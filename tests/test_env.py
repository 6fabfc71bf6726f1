"""tpu_helpers.env (runtime detection, emulation, version checks) and course.setup (the
notebooks' setup cell, built on it).

Detection is tested on real files: fake sysfs trees written to tmp_path (the same layout
as /sys/bus/pci/devices) and explicit environment mappings. Anything that starts the XLA
runtime runs in a fresh subprocess, because the runtime is per process.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import run_python

from course import setup
from tpu_helpers import env
from tpu_helpers.env import EnvironmentProblem, configure_emulation, detect_runtime

#: The supported torch_xla line installed in this venv (2.9 in .venv, 2.8 in .venv-2.8; CI
#: runs this file in both) and the other one, for a deliberately mismatched fake install.
HERE = env.matched_set(env.installed("torch"), env.installed("torch_xla"))
OTHER = env.SUPPORTED["2.8" if HERE.name == "2.9" else "2.9"]


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


def test_layouts_of_the_hosts_a_learner_meets():
    world = {name: env.layout_for(gen, chips).world_size for name, gen, chips in
             [("v3-8", "v3", 4), ("v4-8", "v4", 4), ("v5e-1", "v5e", 1), ("v5e-8", "v5e", 8)]}
    assert world == {"v3-8": 8, "v4-8": 4, "v5e-1": 1, "v5e-8": 8}
    assert env.layout_for("v3").processes == 4 and env.layout_for("v5e").processes == 8
    with pytest.raises(EnvironmentProblem, match="Unknown TPU generation 'v9'"):
        env.layout_for("v9")


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
    assert env.matched_set(versions["torch"], versions["torch_xla"]) is not None  # 2.8 or 2.9


def fake_dists(site: Path, dists: dict[str, str]) -> Path:
    """A folder of real dist-info metadata (no code): put it first on sys.path to fake versions."""
    for name, version in dists.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def test_version_problems_name_the_fix(tmp_path):
    # A real mismatched environment: a venv-free site dir with fake dist-info metadata.
    site = fake_dists(tmp_path / "site", {"torch": "2.8.0", "torch_xla": "2.9.0"})
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
    # torch 2.8 is a supported line: the fix keeps it and brings torch_xla (and libtpu) to 2.8
    assert "pip install 'torch_xla[tpu]==2.8.0' libtpu==0.0.17`" in mismatch[0]
    assert any("libtpu is missing" in p for p in problems)


def test_missing_torch_xla_is_one_sentence(tmp_path):
    proc = run_python(
        """
        import importlib.metadata as md, sys
        real = md.version
        def version(name):
            if name.replace("-", "_") == "torch_xla":
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = version  # hide the installed torch_xla from the metadata lookup
        from tpu_helpers import env
        print("PROBLEMS:", env.version_problems(tpu=False))
        """
    )
    fix = (f"torch_xla is not installed (torch {HERE.torch} is): run "
           f"`pip install torch_xla=={HERE.torch_xla[0]}`")
    assert fix in proc.stdout


def test_version_problems_from_given_versions_are_pure():
    fine = {"torch": "2.9.0+cpu", "torch_xla": "2.9.0", "libtpu": "0.0.21.1"}
    assert env.version_problems(tpu=True, versions=fine) == []
    (problem,) = env.version_problems(tpu=True, versions={**fine, "libtpu": "0.0.23"})
    assert problem.startswith("libtpu 0.0.23 does not fit torch_xla 2.9.0")
    assert problem.endswith("run `pip install libtpu==0.0.21` and restart the runtime.")
    (bare,) = env.version_problems(tpu=False, versions={})
    assert bare == ("torch and torch_xla are not installed: run `pip install torch==2.9.0+cpu "
                    "torch_xla==2.9.0 --extra-index-url https://download.pytorch.org/whl/cpu` "
                    "and restart the runtime.")


# ------------------------------------------------- the setup planner on the platforms' images

DATA = Path(__file__).parent / "data"


def _wheel_version(url: str) -> str:
    """torch-2.9.0%2Bcpu-cp313-...whl -> 2.9.0+cpu"""
    return unquote(url.split("#")[0].rsplit("/", 1)[-1]).split("-")[1]


def parse_pip_freeze(text: str) -> dict[str, str]:
    """``name==version`` and ``name @ url-of-a-wheel`` lines (pip freeze); ``?``: no version."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if " @ " in line:
            name, url = line.split(" @ ", 1)
            out[name] = _wheel_version(url) if url.split("#")[0].endswith(".whl") else "?"
        else:
            name, _, version = line.partition("==")
            out[name] = version or "?"
    return out


def parse_kaggle_packages(text: str) -> dict[str, str]:
    """Kaggle/docker-python's TPU image as tests/data/kaggle-tpu-packages.txt lays it out.

    ``tpu/config.txt`` gives variables, ``tpu/requirements.in`` the requirements with
    ``${VAR}`` in them (URLs of wheels, ``name==version`` or bare names), and the Dockerfile
    step a final ``pip install name==version`` that overrides (libtpu).
    """
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("### "):
            current = line[4:].split()[0]
            sections[current] = []
        elif current:
            sections[current].append(line)
    config = dict(ln.split("=", 1) for ln in sections["tpu/config.txt"]
                  if "=" in ln and not ln.startswith("#"))
    out: dict[str, str] = {}
    for raw in sections["tpu/requirements.in"]:
        line = re.sub(r"\$\{(\w+)\}", lambda m: config[m.group(1)], raw.strip())
        if not line or line.startswith(("#", "-", "git+")):
            continue
        if line.startswith(("http://", "https://")):
            out[unquote(line.rsplit("/", 1)[-1]).split("-")[0]] = _wheel_version(line)
        else:
            m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(==\s*(\S+))?", line)
            assert m, line
            out[m.group(1)] = m.group(4) or "?"
    for line in sections["tpu/Dockerfile"]:
        for name, version in re.findall(r"pip install .*?([A-Za-z0-9_\-]+)==(\S+)", line):
            out[name] = version
    return out


COLAB = parse_pip_freeze((DATA / "colab-tpu-pip-freeze.txt").read_text())
KAGGLE = parse_kaggle_packages((DATA / "kaggle-tpu-packages.txt").read_text())
LIGHT = set(setup.NOTEBOOK_PACKAGES.values())


def test_the_published_package_lists_parse():
    assert {k: COLAB[k] for k in ("torch", "torch-xla", "libtpu", "torchvision", "jax")} == {
        "torch": "2.9.0+cpu", "torch-xla": "2.9.0", "libtpu": "0.0.21.1",
        "torchvision": "0.24.0+cpu", "jax": "0.7.2"}
    assert {k: KAGGLE[k] for k in ("torch", "torch_xla", "libtpu", "torchvision", "torchaudio",
                                   "jax")} == {
        "torch": "2.8.0+cpu", "torch_xla": "2.8.0", "libtpu": "0.0.17",
        "torchvision": "0.23.0+cpu", "torchaudio": "2.8.0+cpu", "jax": "?"}


def _no_cuda(reqs: list[str]) -> None:
    for r in reqs:
        name = r.split("==")[0]
        if name in ("torch", "torchvision", "torchaudio"):
            assert r.endswith("+cpu"), f"{r}: a CUDA build from the package index"


@pytest.mark.parametrize("torch_imported", [False, True])
def test_colab_image_installs_nothing_heavy(torch_imported):
    plan = setup.plan_setup(COLAB, "colab", has_tpu=True, torch_imported=torch_imported)
    assert plan.heavy == [] and plan.changes == {} and not plan.restart_needed
    # Colab's transformers 5.15.0 / accelerate 1.14.0 are older than notebook 11's floor; its
    # image has no peft (notebook 14)
    assert plan.install == ["lightning==2.6.6", "transformers>=5.24.0", "accelerate>=1.15.0",
                            "peft>=0.21.2"]
    assert plan.pip_args == []
    assert "(older here: transformers 5.15.0, accelerate 1.14.0)" in plan.before
    assert plan.target.name == "2.9"
    assert "libtpu 0.0.21.1 (fits torch_xla 2.9.0)" in plan.before  # 0.0.21.1 is not flagged
    assert "nothing heavy to install" in plan.before


def test_kaggle_image_installs_nothing_heavy():
    plan = setup.plan_setup(KAGGLE, "kaggle", has_tpu=True, torch_imported=False)
    assert plan.heavy == [] and plan.changes == {} and plan.pip_args == []
    assert set(plan.install) <= LIGHT and "lightning==2.6.6" in plan.install
    assert plan.target.name == "2.8"  # torch 2.8 + torch_xla 2.8 accepted as they are
    assert "libtpu 0.0.17 (fits torch_xla 2.8.0)" in plan.before
    assert not any(r.startswith(("torch", "libtpu", "jax")) for r in plan.install)


def test_notebook_packages_are_upgraded_only_below_their_floor():
    for have, upgraded in [("5.15.0", True), ("5.23.9", True), ("5.24.0", False),
                           ("5.24.0.dev0", False), ("5.30.1", False), ("6.0.0", False),
                           ("?", False)]:
        image = {**COLAB, "transformers": have, "accelerate": "1.15.0"}
        plan = setup.plan_setup(image, "colab", has_tpu=True, torch_imported=False)
        assert ("transformers>=5.24.0" in plan.install) is upgraded, have
        assert "accelerate>=1.15.0" not in plan.install
    # no floor: any installed version stays (lightning is pinned only for a fresh install)
    plan = setup.plan_setup({**COLAB, "lightning": "2.5.0"}, "colab", True, False)
    assert "lightning==2.6.6" not in plan.install


def test_an_attached_wheels_folder_is_the_only_source(tmp_path):
    (tmp_path / "tpu_helpers-0.1.0-py3-none-any.whl").write_bytes(b"")
    folder = setup.wheels_folder({setup.WHEELS_VAR: str(tmp_path / "tpu_helpers-*.whl")})
    assert folder == str(tmp_path)
    assert setup.wheels_folder({setup.WHEELS_VAR: str(tmp_path / "none" / "*.whl")}) is None
    plan = setup.plan_setup(KAGGLE, "kaggle", has_tpu=True, torch_imported=False, wheels=folder)
    assert plan.pip_args == ["--no-index", "--find-links", folder]
    assert "lightning==2.6.6" in plan.install and plan.heavy == []
    assert f"From the wheels in {folder} only (no package index)." in plan.before
    assert plan.command.endswith(f"--no-index --find-links {folder}")


def test_the_internet_probe_is_quick_and_says_no_for_a_closed_port():
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert not setup.index_reachable({"PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple"})
    assert not setup.index_reachable({"PIP_INDEX_URL": "not a url"})
    assert time.monotonic() - start < setup.PROBE_TIMEOUT


def test_bare_tpu_vm_gets_the_2_9_cpu_set():
    plan = setup.plan_setup({}, "tpu-vm", has_tpu=True, torch_imported=False)
    assert plan.install == []  # a TPU VM is yours: nothing is installed, the fix is printed
    want = ("pip install torch==2.9.0+cpu 'torch_xla[tpu]==2.9.0' libtpu==0.0.21 "
            "--extra-index-url https://download.pytorch.org/whl/cpu")
    assert plan.command == want
    assert plan.problems and all(want in p for p in plan.problems)
    # the same bare TPU host on Colab/Kaggle installs that set plus the notebook packages
    hosted = setup.plan_setup({}, "colab", has_tpu=True, torch_imported=False)
    assert hosted.heavy == ["torch==2.9.0+cpu", "torch_xla[tpu]==2.9.0", "libtpu==0.0.21"]
    assert set(hosted.install) == set(hosted.heavy) | LIGHT
    assert hosted.pip_args == ["--extra-index-url", env.CPU_INDEX]
    _no_cuda(hosted.install)
    assert "CPU builds from https://download.pytorch.org/whl/cpu" in hosted.before


def test_kaggle_without_torch_xla_gets_2_8_matched_to_its_torch():
    image = {k: v for k, v in KAGGLE.items() if k != "torch_xla"}
    plan = setup.plan_setup(image, "kaggle", has_tpu=True, torch_imported=False)
    assert plan.heavy == ["torch_xla==2.8.0"]  # libtpu 0.0.17 fits: no [tpu] extra to move it
    assert plan.pip_args == [] and plan.target.name == "2.8"
    assert "libtpu 0.0.17 (fits torch_xla 2.8.0)" in plan.before
    assert "torch_xla (none) -> 2.8.0" in plan.before


def test_mismatched_pair_gets_a_matched_set_or_a_restart():
    image = {**COLAB, "torch-xla": "2.8.0"}  # torch 2.9 + torch_xla 2.8
    plan = setup.plan_setup(image, "colab", has_tpu=True, torch_imported=False)
    assert plan.heavy == ["torch_xla==2.9.0"] and not plan.restart_needed
    assert "torch 2.9.0+cpu does not match torch_xla 2.8.0" in plan.before
    imported = setup.plan_setup(image, "colab", has_tpu=True, torch_imported=True)
    assert imported.restart_needed and imported.install == []
    assert "restart the runtime, then run this setup cell first" in imported.before


@pytest.mark.parametrize("image", ["colab", "kaggle", "mismatch", "bare", "new-libtpu"])
def test_toolkit_check_and_course_setup_agree(image):
    """The toolkit's version check and the setup cell's plan give the same sentences on a TPU
    VM (where the setup installs nothing and only says the fix), for torch/torch_xla/libtpu."""
    images = {"colab": COLAB, "kaggle": KAGGLE, "mismatch": {**COLAB, "torch-xla": "2.8.0"},
              "bare": {}, "new-libtpu": {**KAGGLE, "libtpu": "0.0.23"}}
    versions = {k.replace("-", "_"): v for k, v in images[image].items()}
    plan = setup.plan_setup({k: versions.get(k) for k in ("torch", "torch_xla", "libtpu")},
                            "tpu-vm", has_tpu=True, torch_imported=False)
    assert env.version_problems(tpu=True, versions=versions) == plan.problems


def test_companions_follow_torch_only_if_present():
    image = {**KAGGLE, "torch": "2.10.0+cpu", "torchvision": "0.25.0+cpu"}
    image.pop("torch_xla")
    plan = setup.plan_setup(image, "kaggle", has_tpu=False, torch_imported=False)
    assert plan.target.name == "2.9"  # torch 2.10 has no torch_xla: the default line
    assert plan.heavy == ["torch==2.9.0+cpu", "torchvision==0.24.0+cpu",
                          "torchaudio==2.9.0+cpu", "torch_xla==2.9.0"]
    _no_cuda(plan.install)
    bare = {k: v for k, v in image.items() if k not in ("torchvision", "torchaudio")}
    plan = setup.plan_setup(bare, "kaggle", has_tpu=False, torch_imported=False)
    assert plan.heavy == ["torch==2.9.0+cpu", "torch_xla==2.9.0"]  # nothing added
    restart = setup.plan_setup(image, "kaggle", has_tpu=False, torch_imported=True)
    assert restart.restart_needed and restart.install == []


def test_libtpu_moves_only_when_the_pair_needs_it():
    # Kaggle/docker-python 1499: jax's newer libtpu broke torch 2.8 (PJRT API mismatch)
    image = {**KAGGLE, "libtpu": "0.0.23"}
    plan = setup.plan_setup(image, "kaggle", has_tpu=True, torch_imported=False)
    assert plan.heavy == ["libtpu==0.0.17"]
    assert "libtpu 0.0.23 does not fit torch_xla 2.8.0" in plan.before
    assert "PJRT" in plan.before and "jax" in plan.before  # says what stays and why
    assert setup.plan_setup(image, "kaggle", False, False).heavy == []  # no TPU: libtpu unused


def test_local_machine_never_installs():
    image = {**COLAB, "torch-xla": None}
    plan = setup.plan_setup(image, "local", has_tpu=False, torch_imported=False)
    assert plan.install == [] and not plan.restart_needed
    assert plan.problems == ["torch_xla is not installed (torch 2.9.0+cpu is): run "
                             "`pip install torch_xla==2.9.0` and restart the runtime."]


def test_pod_command_installs_the_cpu_build_on_every_worker():
    """Notebook 03's pod command: each worker gets torch==X+cpu from PyTorch's CPU index (plain
    torch==X from the package index is the CUDA build: gigabytes a TPU VM never uses)."""
    import json
    import shlex

    cmd = setup.pod_command("my-pod", ["train.py", "checkpoint.py"], "python train.py",
                            version="2.9")
    copy, ssh = cmd.split("\n", 1)
    assert shlex.split(copy)[4:7] == ["scp", "train.py", "checkpoint.py"]
    argv = shlex.split(ssh)
    assert argv[4:6] == ["ssh", "my-pod"] and "--worker=all" in argv
    remote = shlex.split(argv[-1].removeprefix("--command="))  # what each worker runs
    assert remote[:4] == ["pip", "install", "torch==2.9.0+cpu", "torch_xla[tpu]==2.9.0"]
    assert remote[remote.index("--extra-index-url") + 1] == env.CPU_INDEX
    assert remote[-2:] == ["python", "train.py"]
    nb = json.loads((Path(__file__).parent.parent / "notebooks"
                     / "03_multicore_training.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if c.get("id") == "nb03-26")
    assert "pod_command(" in cell and "pip install" not in cell  # the notebook prints this one


def test_install_command_is_a_cpu_build():
    assert setup.install_command(version="2.9") == (
        "pip install torch==2.9.0+cpu 'torch_xla[tpu]==2.9.0' "
        "--extra-index-url https://download.pytorch.org/whl/cpu")
    assert "torch_xla==2.8.0 " in setup.install_command(tpu=False, version="2.8")
    # without a version: the supported line installed here (2.9 in .venv, 2.8 in .venv-2.8)
    assert setup.install_command() == setup.install_command(version=HERE.name)
    assert (setup.TORCH_VERSION, setup.TORCH_XLA_VERSION, setup.LIBTPU_VERSION) == (
        HERE.torch, HERE.torch_xla[0], HERE.libtpu)


# ------------------------------------------------------------ verifying, and setup_notebook


def test_verify_names_a_broken_companion(tmp_path):
    """A torchvision whose ops fail (as after the simulated downgrade) is caught by name."""
    pkg = tmp_path / "fake" / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import ops\n")
    (pkg / "ops.py").write_text(
        "def nms(boxes, scores, iou_threshold):\n"
        "    raise RuntimeError('operator torchvision::nms does not exist')\n")
    crash = tmp_path / "fake" / "torchaudio"
    crash.mkdir()
    (crash / "__init__.py").write_text("import os\nos._exit(134)  # dies while loading\n")
    problems = setup.verify_environment(extra_env={"PYTHONPATH": str(tmp_path / "fake")})
    assert len(problems) == 2, problems
    vision, audio = problems
    assert vision.startswith("torchvision: torchvision.ops.nms on 2 boxes failed: RuntimeError: "
                             "operator torchvision::nms does not exist; fix: ")
    assert f"torchvision=={setup.COMPANION_VERSIONS[HERE.name]['torchvision']}+cpu" in vision
    assert "pip uninstall -y torchvision" in vision
    assert audio.startswith("torchaudio: crashed the process (exit 134)")
    assert setup.verify_environment() == []  # the real venv: torch and torch_xla both work


def test_setup_notebook_reports_a_failed_pip_and_never_says_fine(tmp_path):
    site = fake_dists(tmp_path / "site", {"torch_xla": OTHER.torch_xla[0]})  # beside real torch
    proc = run_python(
        """
        from course.setup import setup_notebook
        from tpu_helpers.env import EnvironmentProblem
        try:
            setup_notebook()
        except EnvironmentProblem as exc:
            print("PROBLEM:", exc)
        """,
        env={"PYTHONPATH": str(site), "COLAB_RELEASE_TAG": "test", "PIP_NO_INDEX": "1",
             "PIP_FIND_LINKS": "", "PYTHONNOUSERSITE": "1"},
    )
    out = proc.stdout
    before = out.index(f"On Colab: torch {HERE.torch} does not match torch_xla "
                       f"{OTHER.torch_xla[0]}")
    problem = out.index("PROBLEM: pip failed")
    assert before < problem, out  # the plan is said before anything changes
    assert f"torch_xla=={HERE.name}" in out[problem:]  # pip's own error tail
    # the manual command: the matched torch_xla first (then any notebook package missing here)
    assert f"run `pip install torch_xla=={HERE.torch_xla[0]}" in out[problem:]
    assert "no TPU attached" not in out and "Changed:" not in out  # no all-fine summary


def test_setup_notebook_asks_for_a_restart_when_torch_is_imported(tmp_path):
    site = fake_dists(tmp_path / "site", {"torch_xla": OTHER.torch_xla[0]})
    proc = run_python(
        """
        import torch
        from course.setup import setup_notebook
        from tpu_helpers.env import EnvironmentProblem
        try:
            setup_notebook()
        except EnvironmentProblem as exc:
            print("PROBLEM:", exc)
        """,
        env={"PYTHONPATH": str(site), "KAGGLE_KERNEL_RUN_TYPE": "Interactive",
             "PIP_NO_INDEX": "1", "PYTHONNOUSERSITE": "1"},
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBLEM:"))
    assert "torch is already imported in this kernel, so nothing was changed" in line
    assert "restart the runtime, then run this setup cell first" in line
    assert "pip failed" not in proc.stdout


def test_setup_notebook_in_a_used_kernel_says_restart():
    proc = run_python(
        """
        import torch, torch_xla
        torch.ones(2, device=torch_xla.device())
        from course.setup import setup_notebook
        from tpu_helpers.env import EnvironmentProblem
        try:
            setup_notebook()
        except EnvironmentProblem as exc:
            print("PROBLEM:", exc)
        """
    )
    assert f"PROBLEM: {setup.RERUN_SENTENCE}" in proc.stdout


def test_pop_kaggle_launcher_vars_is_guarded():
    environ = {"TPU_PROCESS_ADDRESSES": "a:1", "OTHER": "x"}
    assert setup.pop_kaggle_launcher_vars(environ) == ["TPU_PROCESS_ADDRESSES"]
    assert environ == {"OTHER": "x"}
    assert setup.pop_kaggle_launcher_vars(environ) == []  # absent: no error


def test_setup_notebook_locally_installs_nothing():
    proc = run_python(
        """
        import subprocess, sys
        calls = []
        real_run = subprocess.run
        subprocess.run = lambda *a, **k: calls.append(a) or real_run(*a, **k)
        from course.setup import setup_notebook
        rt = setup_notebook()
        rt2 = setup_notebook()  # idempotent
        print("CALLS", len(calls), rt.platform, rt == rt2, "torch" in sys.modules)
        """, fresh=True)
    assert "CALLS 0 local True False" in proc.stdout, proc.stdout
    assert "no TPU attached" in proc.stdout


@pytest.mark.both_lines  # "versions: OK" is env.version_problems' verdict on this release
def test_report_runs_as_a_command():
    proc = run_python("import runpy; runpy.run_module('tpu_helpers.env', run_name='__main__')")
    assert f"torch_xla  {env.installed('torch_xla')}" in proc.stdout
    assert "versions: OK" in proc.stdout
