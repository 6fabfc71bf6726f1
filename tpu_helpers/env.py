"""Where am I running, and is it set up right? Runtime detection and local TPU emulation.

Taught in ``notebooks/00_environment.ipynb``; every notebook's setup cell calls
:func:`setup_notebook` and its config cell calls :func:`configure_emulation`.

Nothing here initialises the XLA runtime or touches an XLA device: detection reads
environment variables, ``/sys/bus/pci`` (the same source ``torch_xla._internal.tpu`` uses)
and package metadata only, so calling it never breaks a later ``torch_xla.launch``.

Run ``python -m tpu_helpers.env`` for a one-screen report of this machine.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

#: The matched pair this project pins (torch_xla 2.9.0 is the last release).
TORCH_VERSION = "2.9.0"
TORCH_XLA_VERSION = "2.9.0"
#: The libtpu that ``torch_xla[tpu]==2.9.0`` pins.
LIBTPU_VERSION = "0.0.21"
#: Packages (import name -> pip requirement) the notebooks need beyond torch/torch_xla;
#: installed on Colab/Kaggle only when missing.
NOTEBOOK_PACKAGES = {
    "lightning": "lightning==2.6.6",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "PIL": "pillow",
    "psutil": "psutil",
}
#: Variables Kaggle's TPU images set for their own launcher; they confuse torch_xla.launch.
KAGGLE_LAUNCHER_VARS = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")

_GOOGLE_PCI_VENDOR = "0x1ae0"
#: PCI device id -> TPU generation (from torch_xla/_internal/tpu.py, v2.9.0).
_PCI_GENERATION = {
    "0x0027": "v3",  # v2 and v3 share an id; v3 is the one still offered (Kaggle's old v3-8)
    "0x005e": "v4",
    "0x0063": "v5e",
    "0x0062": "v5p",
    "0x006f": "v6e",
}


class EnvironmentProblem(RuntimeError):
    """A setup problem explained in one sentence with its fix (no XLA log stack).

    In Jupyter only the sentence is shown, not a traceback.
    """

    def _render_traceback_(self) -> list[str]:  # IPython hook: show just the message
        return [f"EnvironmentProblem: {self}"]


@dataclass(frozen=True)
class Layout:
    """How ``torch_xla.launch`` lays out processes and devices on one host."""

    processes: int
    devices_per_process: int
    note: str = ""

    @property
    def world_size(self) -> int:
        """``xr.world_size()`` inside ``torch_xla.launch`` (multi-process mode)."""
        return self.processes * self.devices_per_process


#: Per TPU generation: (chips on the usual single host, TPU cores per chip, note).
GENERATIONS: dict[str, tuple[int, int, str]] = {
    "v2": (4, 2, "v2-8: 4 processes x 2 threads; threads share the global RNG"),
    "v3": (4, 2, "v3-8 (old Kaggle): 4 processes x 2 threads; threads share the RNG"),
    "v4": (4, 1, "v4-8: 4 chips, one megacore device each"),
    "v5e": (8, 1, "v5e-8 (Kaggle): 8 processes; v5e-1 (Colab): 1 process"),
    "v5p": (4, 1, "v5p-8: 4 chips, one megacore device each"),
    "v6e": (8, 1, "v6e-8: 8 processes; v6e-1 (Colab): 1 process"),
}


def layout_for(generation: str, chips: int | None = None) -> Layout:
    """The expected ``torch_xla.launch`` layout for ``chips`` chips of a generation."""
    if generation not in GENERATIONS:
        raise EnvironmentProblem(
            f"Unknown TPU generation {generation!r}; known: {', '.join(GENERATIONS)}."
        )
    usual, cores, note = GENERATIONS[generation]
    n = usual if chips is None else chips
    return Layout(processes=n, devices_per_process=cores, note=note)


def layout_table():
    """All known single-host layouts as a pandas DataFrame (the table in notebook 00)."""
    import pandas as pd

    rows = []
    for accel, gen, chips in [
        ("v2-8", "v2", 4), ("v3-8", "v3", 4), ("v4-8", "v4", 4), ("v5e-1 (Colab)", "v5e", 1),
        ("v5e-8 (Kaggle)", "v5e", 8), ("v5p-8", "v5p", 4), ("v6e-1 (Colab)", "v6e", 1),
        ("v6e-8", "v6e", 8),
    ]:
        lay = layout_for(gen, chips)
        rows.append({"TPU": accel, "chips": chips, "processes": lay.processes,
                     "devices/process": lay.devices_per_process, "world size": lay.world_size})
    rows.append({"TPU": "XLA:CPU here (launch)", "chips": 0, "processes": 1,
                 "devices/process": 1, "world size": 1})
    rows.append({"TPU": "XLA:CPU here (SPMD, CPU_NUM_DEVICES=4)", "chips": 0, "processes": 1,
                 "devices/process": 4, "world size": 1})
    return pd.DataFrame(rows).set_index("TPU")


@dataclass(frozen=True)
class Runtime:
    """What :func:`detect_runtime` found. ``platform`` is colab, kaggle, tpu-vm or local."""

    platform: str
    tpu_generation: str | None = None
    chips: int = 0
    accelerator_type: str | None = None
    layout: Layout = field(default_factory=lambda: Layout(1, 1, "XLA:CPU emulation"))

    @property
    def has_tpu(self) -> bool:
        return self.chips > 0 or self.tpu_generation is not None

    def summary(self) -> str:
        where = {"colab": "Google Colab", "kaggle": "Kaggle", "tpu-vm": "a TPU VM",
                 "local": "a machine without TPU"}[self.platform]
        if not self.has_tpu:
            return f"{where}: no TPU attached, using the XLA:CPU emulation (PJRT_DEVICE=CPU)"
        accel = self.accelerator_type or f"{self.tpu_generation} x{self.chips}"
        lay = self.layout
        return (f"{where}: TPU {accel}; torch_xla.launch runs {lay.processes} process(es) x "
                f"{lay.devices_per_process} device(s) = world size {lay.world_size}")


def _generation_from_type(accel: str) -> str:
    m = re.match(r"^(v\d+)(litepod|lite|e|p)?-?", accel)
    if not m:
        raise EnvironmentProblem(
            f"Unknown TPU accelerator type {accel!r} in TPU_ACCELERATOR_TYPE; "
            "expected a name like v5litepod-8 or v4-8 (unset it if it is wrong)."
        )
    base, suffix = m.group(1), m.group(2) or ""
    gen = base + ("e" if suffix in ("lite", "litepod", "e") else "p" if suffix == "p" else "")
    if gen not in GENERATIONS:
        raise EnvironmentProblem(
            f"Unknown TPU generation {gen!r} (from TPU_ACCELERATOR_TYPE={accel!r}); "
            f"this project knows {', '.join(GENERATIONS)}."
        )
    return gen


def tpu_chips(pci_root: str | Path = "/sys/bus/pci/devices") -> tuple[int, str | None]:
    """Count TPU chips on PCI and name their generation, reading only sysfs files."""
    chips, gen = 0, None
    for vendor in Path(pci_root).glob("*/vendor"):
        try:
            if vendor.read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            dev = (vendor.parent / "device").read_text().strip()
        except OSError:
            continue
        if dev in _PCI_GENERATION:
            chips += 1
            gen = _PCI_GENERATION[dev]
    return chips, gen


def detect_runtime(
    environ: Mapping[str, str] | None = None,
    pci_root: str | Path = "/sys/bus/pci/devices",
    kaggle_dir: str | Path = "/kaggle",
) -> Runtime:
    """Detect Colab / Kaggle / TPU VM / local, the TPU generation, chips and layout.

    Reads environment variables and sysfs only; never initialises the XLA runtime.
    Raises :class:`EnvironmentProblem` for settings that cannot work (e.g.
    ``PJRT_DEVICE=TPU`` with no TPU attached, or an unknown accelerator type).
    """
    env = os.environ if environ is None else environ
    if "COLAB_RELEASE_TAG" in env or "COLAB_BACKEND_VERSION" in env:
        platform = "colab"
    elif "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env or Path(kaggle_dir).is_dir():
        platform = "kaggle"
    else:
        platform = "local"

    chips, gen = tpu_chips(pci_root)
    accel = env.get("TPU_ACCELERATOR_TYPE") or None
    if accel:
        gen = _generation_from_type(accel)
        m = re.search(r"-(\d+)$", accel)
        if not chips and m:
            cores = int(m.group(1))
            per_chip = GENERATIONS[gen][1] if gen in ("v2", "v3") else 1
            chips = max(1, min(cores // per_chip, GENERATIONS[gen][0]))
    if platform == "local" and (chips or accel):
        platform = "tpu-vm"

    pjrt = env.get("PJRT_DEVICE", "")
    if pjrt.upper() == "TPU" and not chips and not accel:
        raise EnvironmentProblem(
            "PJRT_DEVICE=TPU is set but no TPU chip is attached to this machine; "
            "unset PJRT_DEVICE (or call configure_emulation()) to use the XLA:CPU emulation."
        )
    if pjrt and pjrt.upper() not in ("TPU", "CPU"):
        raise EnvironmentProblem(
            f"PJRT_DEVICE={pjrt} is not supported by these notebooks; "
            "use TPU on a TPU machine or CPU for the local emulation."
        )
    if gen is None:
        return Runtime(platform=platform)
    return Runtime(platform=platform, tpu_generation=gen, chips=chips, accelerator_type=accel,
                   layout=layout_for(gen, chips or None))


# --------------------------------------------------------------------------- versions


def _installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _base(version: str) -> str:
    return version.split("+")[0]


def install_command(tpu: bool = True) -> str:
    """The exact pip command that installs the matched pair."""
    xla = f"'torch_xla[tpu]=={TORCH_XLA_VERSION}'" if tpu else f"torch_xla=={TORCH_XLA_VERSION}"
    return f"pip install torch=={TORCH_VERSION} {xla}"


def version_problems(tpu: bool | None = None) -> list[str]:
    """Each problem with torch / torch_xla / libtpu, as one sentence with the exact fix.

    Reads package metadata only (nothing is imported). ``tpu`` says whether libtpu is
    needed; by default it is when a TPU is attached.
    """
    if tpu is None:
        tpu = tpu_chips()[0] > 0
    fix = install_command(tpu)
    torch_v, xla_v = _installed("torch"), _installed("torch_xla")
    problems = []
    if torch_v is None:
        problems.append(f"torch is not installed: run `{fix}`.")
    if xla_v is None:
        problems.append(f"torch_xla is not installed: run `{fix}`.")
    if torch_v and xla_v and _base(torch_v) != _base(xla_v):
        problems.append(
            f"torch {torch_v} does not match torch_xla {xla_v} (they must be the same "
            f"release): run `{fix}` and restart the runtime."
        )
    elif xla_v and _base(xla_v) != TORCH_XLA_VERSION:
        problems.append(
            f"torch_xla {xla_v} is not the {TORCH_XLA_VERSION} these notebooks are tested "
            f"with: run `{fix}` and restart the runtime."
        )
    if tpu:
        lib = _installed("libtpu")
        if lib is None:
            problems.append(f"libtpu is missing on this TPU machine: run `{fix}`.")
        elif lib != LIBTPU_VERSION:
            problems.append(
                f"libtpu {lib} is not the {LIBTPU_VERSION} that torch_xla[tpu]=="
                f"{TORCH_XLA_VERSION} pins: run `{fix}` and restart the runtime."
            )
    return problems


def check_versions(tpu: bool | None = None) -> dict[str, str | None]:
    """Return the installed versions, or raise :class:`EnvironmentProblem` on a mismatch."""
    problems = version_problems(tpu)
    if problems:
        raise EnvironmentProblem(" ".join(problems))
    return {d: _installed(d) for d in ("torch", "torch_xla", "libtpu")}


# --------------------------------------------------------------------------- emulation


def runtime_initialized() -> bool:
    """True if this process has already started the XLA runtime (without starting it)."""
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def configure_emulation(
    num_devices: int = 1,
    environ: MutableMapping[str, str] | None = None,
    runtime: Runtime | None = None,
) -> Runtime:
    """Make a machine without TPU stand in for one: ``PJRT_DEVICE=CPU`` with N devices.

    Call it in the config cell, before anything touches the XLA device. ``num_devices``
    is the number of virtual XLA:CPU devices (4 for the SPMD notebooks; 1 for notebooks
    that use ``torch_xla.launch``, where cross-process collectives cannot run on CPU).
    On a real TPU it changes nothing. If the runtime already started with different
    settings it raises :class:`EnvironmentProblem` telling you to restart the kernel.
    """
    env = os.environ if environ is None else environ
    if num_devices < 1:
        raise EnvironmentProblem(f"num_devices must be >= 1, got {num_devices}.")
    rt = runtime or detect_runtime(env)
    if rt.has_tpu:
        return rt
    wanted = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(num_devices)}
    if environ is None and runtime_initialized():
        import torch_xla.runtime as xr

        have_dev = env.get("PJRT_DEVICE", "?")
        have_n = xr.global_runtime_device_count()
        if have_dev.upper() != "CPU" or have_n != num_devices:
            raise EnvironmentProblem(
                f"The XLA runtime is already running with PJRT_DEVICE={have_dev} and "
                f"{have_n} device(s), but {num_devices} CPU device(s) were asked for: "
                "restart the kernel and run the config cell before anything touches the device."
            )
        return rt
    env.update(wanted)
    # XLA's C++ INFO lines on CPU are noise for a tutorial; warnings still show.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return rt


# --------------------------------------------------------------------------- notebooks


def pop_kaggle_launcher_vars(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove Kaggle's launcher variables if present (guarded); return the ones removed."""
    env = os.environ if environ is None else environ
    return [k for k in KAGGLE_LAUNCHER_VARS if env.pop(k, None) is not None]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def setup_notebook(install: bool = True, quiet: bool = False) -> Runtime:
    """The notebooks' setup cell: idempotent, quiet, pinned.

    * Colab / Kaggle: installs ``torch==2.9.0`` and ``torch_xla[tpu]==2.9.0`` only if the
      installed pair is missing or mismatched, plus any missing notebook package; pops
      Kaggle's launcher variables (guarded).
    * TPU VM / local: installs nothing; raises :class:`EnvironmentProblem` with the fix if
      torch / torch_xla are missing or mismatched.
    """
    rt = detect_runtime()
    if rt.platform == "kaggle":
        pop_kaggle_launcher_vars()
    problems = version_problems(tpu=rt.has_tpu)
    if problems and install and rt.platform in ("colab", "kaggle"):
        if "torch" in sys.modules:
            raise EnvironmentProblem(
                " ".join(problems) + " torch is already imported in this kernel, so: "
                "restart the runtime, then run this cell first."
            )
        pair = [f"torch=={TORCH_VERSION}",
                f"torch_xla[tpu]=={TORCH_XLA_VERSION}" if rt.has_tpu
                else f"torch_xla=={TORCH_XLA_VERSION}"]
        _pip(*pair)
        problems = version_problems(tpu=rt.has_tpu)
    if problems:
        raise EnvironmentProblem(" ".join(problems))
    if install and rt.platform in ("colab", "kaggle"):
        missing = [req for mod, req in NOTEBOOK_PACKAGES.items()
                   if importlib.util.find_spec(mod) is None]
        if missing:
            _pip(*missing)
    if not quiet:
        print(f"{rt.summary()}. torch {_installed('torch')}, torch_xla {_installed('torch_xla')}.")
    return rt


def report() -> str:
    """A short human-readable report of this machine (``python -m tpu_helpers.env``)."""
    rt = detect_runtime()
    lines = [rt.summary()]
    for d in ("torch", "torch_xla", "libtpu", "lightning"):
        lines.append(f"  {d:10s} {_installed(d) or '-'}")
    problems = version_problems(tpu=rt.has_tpu)
    lines += [f"  problem: {p}" for p in problems] or ["  versions: OK"]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        print(report())
    except EnvironmentProblem as exc:
        print(f"EnvironmentProblem: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
