"""Where am I running, and is it set up right? Runtime detection, local TPU emulation, versions.

Taught in ``notebooks/00_environment.ipynb``. Needs no sibling: standard library only, so
``env.py`` can be copied alone into any project (``python env.py`` prints a report).

Nothing here initialises the XLA runtime or touches an XLA device: detection reads
environment variables, ``/sys/bus/pci`` (the same source ``torch_xla._internal.tpu`` uses)
and package metadata only, so calling it never breaks a later ``torch_xla.launch``.

Versions: :data:`SUPPORTED` lists the matched sets (torch_xla 2.9 as on Colab, 2.8 as on
Kaggle); :func:`version_problems` names each mismatch with the exact pip command that fixes it.
(The course's setup cell, which installs on Colab/Kaggle, is ``course/setup.py``, not here.)
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

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


def _check_pjrt(env: Mapping[str, str], tpu_found: bool) -> None:
    pjrt = env.get("PJRT_DEVICE", "")
    if pjrt.upper() == "TPU" and not tpu_found:
        raise EnvironmentProblem(
            "PJRT_DEVICE=TPU is set but no TPU chip is attached to this machine; "
            "unset PJRT_DEVICE (or call configure_emulation()) to use the XLA:CPU emulation."
        )
    if pjrt and pjrt.upper() not in ("TPU", "CPU"):
        raise EnvironmentProblem(
            f"PJRT_DEVICE={pjrt} is not supported by these notebooks; "
            "use TPU on a TPU machine or CPU for the local emulation."
        )


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
            per_chip = GENERATIONS[gen][1] if gen in ("v2", "v3") else 1
            chips = max(1, min(int(m.group(1)) // per_chip, GENERATIONS[gen][0]))
    if platform == "local" and (chips or accel):
        platform = "tpu-vm"
    _check_pjrt(env, bool(chips or accel))
    if gen is None:
        return Runtime(platform=platform)
    return Runtime(platform=platform, tpu_generation=gen, chips=chips, accelerator_type=accel,
                   layout=layout_for(gen, chips or None))


# --------------------------------------------------------------------------- versions


@dataclass(frozen=True)
class MatchedSet:
    """One supported release line: torch and torch_xla are the same release, and
    ``torch_xla[tpu]`` pins ``libtpu`` (a platform build of it, Colab's ``0.0.21.1``, fits too)."""

    name: str
    torch: str
    #: Accepted torch_xla releases for this torch; the first is the one installed.
    torch_xla: tuple[str, ...]
    libtpu: str

    def fits_libtpu(self, version: str | None) -> bool:
        return version is not None and (version == self.libtpu
                                        or version.startswith(self.libtpu + "."))


#: The supported matched sets (torch_xla 2.9.0 is the last release; Kaggle ships 2.8).
SUPPORTED: dict[str, MatchedSet] = {
    "2.9": MatchedSet("2.9", torch="2.9.0", torch_xla=("2.9.0",), libtpu="0.0.21"),
    "2.8": MatchedSet("2.8", torch="2.8.0", torch_xla=("2.8.0", "2.8.1"), libtpu="0.0.17"),
}
#: What gets installed when no supported torch is present.
DEFAULT_SET = "2.9"
#: PyTorch's own index of CPU builds (``torch==2.9.0+cpu``); Colab and Kaggle can reach it.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def installed(dist: str) -> str | None:
    """The installed version of a distribution (package metadata only), or None."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _base(version: str) -> str:
    return version.split("+")[0]


def matched_set(torch_version: str | None, xla_version: str | None) -> MatchedSet | None:
    """The supported set this torch / torch_xla pair belongs to, or None."""
    if not torch_version or not xla_version:
        return None
    for s in SUPPORTED.values():
        if _base(torch_version) == s.torch and _base(xla_version) in s.torch_xla:
            return s
    return None


def target_set(torch_version: str | None) -> MatchedSet:
    """The set to install: the installed torch's line (2.8 or 2.9) if supported, else 2.9."""
    if torch_version:
        minor = ".".join(_base(torch_version).split(".")[:2])
        if minor in SUPPORTED:
            return SUPPORTED[minor]
    return SUPPORTED[DEFAULT_SET]


def active_set() -> MatchedSet:
    """The supported set of the installed pair, else the set a setup here would install."""
    torch_v, xla_v = installed("torch"), installed("torch_xla")
    return matched_set(torch_v, xla_v) or target_set(torch_v)


_ACTIVE = active_set()
#: The supported pair in use here: the installed one if supported, else the default (2.9).
TORCH_VERSION = _ACTIVE.torch
TORCH_XLA_VERSION = next((v for v in _ACTIVE.torch_xla
                          if _base(installed("torch_xla") or "") == v), _ACTIVE.torch_xla[0])
#: The libtpu that ``torch_xla[tpu]==TORCH_XLA_VERSION`` pins.
LIBTPU_VERSION = _ACTIVE.libtpu


def pip_command(install: list[str], pip_args: list[str] | None = None) -> str:
    """The pip command line a user can paste."""
    quoted = [f"'{r}'" if "[" in r else r for r in install]
    return " ".join(["pip install", *quoted, *(pip_args or [])])


def install_command(tpu: bool = True, version: str | None = None) -> str:
    """The exact pip command that installs a matched CPU-build pair (``version``: 2.8 or 2.9;
    default: the pair in use here)."""
    s = SUPPORTED[version] if version else _ACTIVE
    xla = s.torch_xla[0] if version else TORCH_XLA_VERSION
    return pip_command([f"torch=={s.torch}+cpu",
                        f"torch_xla[tpu]=={xla}" if tpu else f"torch_xla=={xla}"],
                       ["--extra-index-url", CPU_INDEX])


class VersionFix(NamedTuple):
    """What :func:`version_fix` decided: the set to reach and how."""

    target: MatchedSet
    #: distribution (torch, torch-xla, libtpu) -> (installed version or None, requirement).
    changes: dict[str, tuple[str | None, str]]
    #: One sentence per problem (empty: nothing to fix).
    reasons: list[str]
    #: What is fine and stays, in words.
    kept: list[str]


def _describe(torch_v: str | None, xla_v: str | None, target: MatchedSet) -> str:
    if torch_v is None:
        return ("torch and torch_xla are not installed" if xla_v is None
                else "torch is not installed")
    if xla_v is None and _base(torch_v) == target.torch:
        return f"torch_xla is not installed (torch {torch_v} is)"
    if _base(torch_v) != target.torch:
        return (f"torch {torch_v} has no torch_xla release (supported pairs: "
                + ", ".join(f"torch {s.torch} + torch_xla {'/'.join(s.torch_xla)}"
                            for s in SUPPORTED.values()) + ")")
    return f"torch {torch_v} does not match torch_xla {xla_v} (they must be the same release)"


def version_fix(torch_v: str | None, xla_v: str | None, libtpu_v: str | None,
                tpu: bool) -> VersionFix:
    """Decide, as pure data, which of torch / torch_xla / libtpu must change and why.

    A supported matched pair stays. Otherwise the target is the installed torch's line (2.8
    or 2.9; else 2.9), as CPU builds (``torch==X+cpu``). On a TPU, libtpu must fit the pair;
    if it does not, ``torch_xla[tpu]`` (which pins it) and that libtpu are installed.
    """
    pair = matched_set(torch_v, xla_v)
    target = pair or target_set(torch_v)
    changes: dict[str, tuple[str | None, str]] = {}
    reasons, kept = [], []
    if pair is None:
        reasons.append(_describe(torch_v, xla_v, target))
        if torch_v is None or _base(torch_v) != target.torch:
            changes["torch"] = (torch_v, f"torch=={target.torch}+cpu")
        if xla_v is None or _base(xla_v) not in target.torch_xla:
            changes["torch-xla"] = (xla_v, f"torch_xla=={target.torch_xla[0]}")
    else:
        kept.append(f"torch {torch_v} and torch_xla {xla_v} (a supported matched pair)")
    xla_after = target.torch_xla[0] if "torch-xla" in changes else _base(xla_v or "")
    if tpu and target.fits_libtpu(libtpu_v):
        kept.append(f"libtpu {libtpu_v} (fits torch_xla {xla_after})")
    elif tpu:
        reasons.append(f"libtpu is missing and torch_xla {xla_after} needs libtpu {target.libtpu}"
                       if libtpu_v is None else
                       f"libtpu {libtpu_v} does not fit torch_xla {xla_after}, which was built "
                       f"against libtpu {target.libtpu} (another one fails with a PJRT API "
                       "mismatch)")
        if "torch-xla" in changes:  # the tpu extra brings the pinned libtpu
            changes["torch-xla"] = (xla_v, f"torch_xla[tpu]=={target.torch_xla[0]}")
        changes["libtpu"] = (libtpu_v, f"libtpu=={target.libtpu}")
    return VersionFix(target, changes, reasons, kept)


def fix_command(fix: VersionFix) -> str:
    """The one pip command that carries out ``fix`` (CPU builds come from :data:`CPU_INDEX`)."""
    reqs = [req for _, req in fix.changes.values()]
    cpu = any("+cpu" in r for r in reqs)
    return pip_command(reqs, ["--extra-index-url", CPU_INDEX] if cpu else [])


def version_problems(tpu: bool | None = None,
                     versions: Mapping[str, str | None] | None = None) -> list[str]:
    """Each problem with torch / torch_xla / libtpu, as one sentence with the exact fix.

    Reads package metadata only (nothing is imported); ``versions`` (torch, torch_xla,
    libtpu) replaces it. ``tpu`` says whether libtpu is needed; by default it is when a TPU
    is attached. Any supported matched pair is fine.
    """
    if tpu is None:
        tpu = tpu_chips()[0] > 0
    v = versions if versions is not None else {d: installed(d)
                                               for d in ("torch", "torch_xla", "libtpu")}
    fix = version_fix(v.get("torch"), v.get("torch_xla"), v.get("libtpu"), tpu)
    return [f"{r}: run `{fix_command(fix)}` and restart the runtime." for r in fix.reasons]


def check_versions(tpu: bool | None = None) -> dict[str, str | None]:
    """Return the installed versions, or raise :class:`EnvironmentProblem` on a mismatch."""
    problems = version_problems(tpu)
    if problems:
        raise EnvironmentProblem(" ".join(problems))
    return {d: installed(d) for d in ("torch", "torch_xla", "libtpu")}


# --------------------------------------------------------------------------- emulation


def runtime_initialized() -> bool:
    """True if this process has already started the XLA runtime (without starting it)."""
    if "torch_xla" not in sys.modules:
        return False
    # Deferred on purpose: importing torch_xla here would slow every import of this module;
    # torch_xla is already imported (checked above), so this import is free.
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
    if environ is None and runtime_initialized():
        import torch_xla.runtime as xr  # deferred: only reached once the runtime is running

        have_dev, have_n = env.get("PJRT_DEVICE", "?"), xr.global_runtime_device_count()
        if have_dev.upper() != "CPU" or have_n != num_devices:
            raise EnvironmentProblem(
                f"The XLA runtime is already running with PJRT_DEVICE={have_dev} and "
                f"{have_n} device(s), but {num_devices} CPU device(s) were asked for: "
                "restart the kernel and run the config cell before anything touches the device."
            )
        return rt
    env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(num_devices)})
    # XLA's C++ INFO lines on CPU are noise for a tutorial; warnings still show.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return rt


def pop_kaggle_launcher_vars(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove Kaggle's launcher variables if present (guarded); return the ones removed."""
    env = os.environ if environ is None else environ
    return [k for k in KAGGLE_LAUNCHER_VARS if env.pop(k, None) is not None]


def report() -> str:
    """A short human-readable report of this machine (``python -m tpu_helpers.env``)."""
    rt = detect_runtime()
    lines = [rt.summary()]
    lines += [f"  {d:10s} {installed(d) or '-'}" for d in ("torch", "torch_xla", "libtpu")]
    problems = version_problems(tpu=rt.has_tpu)
    lines += [f"  problem: {p}" for p in problems] or ["  versions: OK"]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        print(report())
    except EnvironmentProblem as exc:
        print(f"EnvironmentProblem: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
