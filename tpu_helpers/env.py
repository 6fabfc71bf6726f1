"""Where am I running, and is it set up right? Runtime detection, local TPU emulation, versions.

Taught in notebook 00. Standard library only (``python env.py`` prints a report); reads
environment variables, ``/sys/bus/pci`` and package metadata, never the XLA device.
"""

import importlib.metadata as md
import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

#: Google's PCI device id -> TPU generation (torch_xla/_internal/tpu.py, v2.9.0; v2 = v3's id).
_PCI = {"0x0027": "v3", "0x005e": "v4", "0x0063": "v5e", "0x0062": "v5p", "0x006f": "v6e"}


class EnvironmentProblem(RuntimeError):
    """A setup problem in one sentence with its fix; Jupyter shows it without a traceback."""

    def _render_traceback_(self) -> list[str]:  # IPython hook
        return [f"EnvironmentProblem: {self}"]


@dataclass(frozen=True)
class Layout:
    """How ``torch_xla.launch`` lays out processes and devices on one host."""

    processes: int
    devices_per_process: int

    @property
    def world_size(self) -> int:
        return self.processes * self.devices_per_process


#: Per TPU generation: (chips on the usual single host, TPU cores per chip).
GENERATIONS: dict[str, tuple[int, int]] = {
    "v2": (4, 2),  # v2-8: 4 processes x 2 threads; threads share the global RNG
    "v3": (4, 2),  # v3-8 (old Kaggle): 4 processes x 2 threads; threads share the RNG
    "v4": (4, 1),  # v4-8: 4 chips, one megacore device each
    "v5e": (8, 1),  # v5e-8 (Kaggle): 8 processes; v5e-1 (Colab): 1 process
    "v5p": (4, 1),  # v5p-8: 4 chips, one megacore device each
    "v6e": (8, 1),  # v6e-8: 8 processes; v6e-1 (Colab): 1 process
}


def layout_for(generation: str, chips: int | None = None) -> Layout:
    """The expected ``torch_xla.launch`` layout for ``chips`` chips of a generation."""
    if generation not in GENERATIONS:
        raise EnvironmentProblem(
            f"Unknown TPU generation {generation!r}; known: {', '.join(GENERATIONS)}.")
    usual, cores = GENERATIONS[generation]
    return Layout(usual if chips is None else chips, cores)


@dataclass(frozen=True)
class Runtime:
    """What :func:`detect_runtime` found. ``platform`` is colab, kaggle, tpu-vm or local."""
    platform: str
    tpu_generation: str | None = None
    chips: int = 0
    accelerator_type: str | None = None
    layout: Layout = Layout(1, 1)  # XLA:CPU emulation

    @property
    def has_tpu(self) -> bool:
        return self.chips > 0 or self.tpu_generation is not None

    def summary(self) -> str:
        where = {"colab": "Google Colab", "kaggle": "Kaggle", "tpu-vm": "a TPU VM",
                 "local": "a machine without TPU"}[self.platform]
        if not self.has_tpu:
            return f"{where}: no TPU attached, using the XLA:CPU emulation (PJRT_DEVICE=CPU)"
        lay, accel = self.layout, self.accelerator_type or f"{self.tpu_generation} x{self.chips}"
        return (f"{where}: TPU {accel}; torch_xla.launch runs {lay.processes} process(es) x "
                f"{lay.devices_per_process} device(s) = world size {lay.world_size}")


def tpu_chips(pci_root: str | Path = "/sys/bus/pci/devices") -> tuple[int, str | None]:
    """Count TPU chips on PCI and name their generation, reading only sysfs files."""
    chips, gen = 0, None
    for vendor in Path(pci_root).glob("*/vendor"):
        try:
            if vendor.read_text().strip() != "0x1ae0":  # Google
                continue
            dev = (vendor.parent / "device").read_text().strip()
        except OSError:
            continue
        if dev in _PCI:
            chips, gen = chips + 1, _PCI[dev]
    return chips, gen


def detect_runtime(environ: Mapping[str, str] | None = None,
                   pci_root: str | Path = "/sys/bus/pci/devices",
                   kaggle_dir: str | Path = "/kaggle") -> Runtime:
    """Detect Colab / Kaggle / TPU VM / local, the TPU generation, chips and layout; raise
    :class:`EnvironmentProblem` for settings that cannot work (e.g. ``PJRT_DEVICE=TPU``, no TPU)."""
    env = os.environ if environ is None else environ
    platform = ("colab" if {"COLAB_RELEASE_TAG", "COLAB_BACKEND_VERSION"} & env.keys() else
                "kaggle" if {"KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE"} & env.keys()
                or Path(kaggle_dir).is_dir() else "local")
    chips, gen = tpu_chips(pci_root)
    accel = env.get("TPU_ACCELERATOR_TYPE") or None
    if accel:
        m = re.match(r"^(v\d+)(litepod|lite|e|p)?-?", accel)
        if not m:
            raise EnvironmentProblem(
                f"Unknown TPU accelerator type {accel!r} in TPU_ACCELERATOR_TYPE; expected a "
                "name like v5litepod-8 or v4-8 (unset it if it is wrong).")
        gen = m.group(1) + {"lite": "e", "litepod": "e", "e": "e", "p": "p"}.get(m.group(2), "")
        if gen not in GENERATIONS:
            raise EnvironmentProblem(
                f"Unknown TPU generation {gen!r} (from TPU_ACCELERATOR_TYPE={accel!r}); "
                f"this project knows {', '.join(GENERATIONS)}.")
        size = re.search(r"-(\d+)$", accel)
        if not chips and size:  # -N counts cores on v2/v3, chips since v4
            chips = max(1, min(int(size.group(1)) // GENERATIONS[gen][1], GENERATIONS[gen][0]))
    platform = "tpu-vm" if platform == "local" and (chips or accel) else platform
    pjrt = env.get("PJRT_DEVICE", "").upper()
    if pjrt == "TPU" and not (chips or accel):
        raise EnvironmentProblem(
            "PJRT_DEVICE=TPU is set but no TPU chip is attached to this machine; unset "
            "PJRT_DEVICE (or call configure_emulation()) to use the XLA:CPU emulation.")
    if pjrt not in ("", "TPU", "CPU"):
        raise EnvironmentProblem(
            f"PJRT_DEVICE={env['PJRT_DEVICE']} is not supported by these notebooks; "
            "use TPU on a TPU machine or CPU for the local emulation.")
    return Runtime(platform) if gen is None else Runtime(platform, gen, chips, accel,
                                                         layout_for(gen, chips or None))


@dataclass(frozen=True)
class MatchedSet:
    """A supported release line: torch, torch_xla and the libtpu ``torch_xla[tpu]`` pins."""
    name: str
    torch: str
    torch_xla: tuple[str, ...]  # accepted releases for this torch; the first is installed
    libtpu: str


SUPPORTED: dict[str, MatchedSet] = {
    "2.9": MatchedSet("2.9", torch="2.9.0", torch_xla=("2.9.0",), libtpu="0.0.21"),
    "2.8": MatchedSet("2.8", torch="2.8.0", torch_xla=("2.8.0", "2.8.1"), libtpu="0.0.17"),
}
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
    return next((s for s in SUPPORTED.values() if torch_version and xla_version
                 and _base(torch_version) == s.torch and _base(xla_version) in s.torch_xla), None)


def pip_command(install: list[str], pip_args: list[str] | None = None) -> str:
    """The pip command line a user can paste."""
    return " ".join(["pip install", *(f"'{r}'" if "[" in r else r for r in install),
                     *(pip_args or [])])


def version_fix(torch_v: str | None, xla_v: str | None, libtpu_v: str | None, tpu: bool
                ) -> tuple[MatchedSet, dict[str, tuple[str | None, str]], list[str]]:
    """Decide, as pure data, which of torch / torch_xla / libtpu must change and why: a
    supported pair stays, else the installed torch's line (2.8 or 2.9; else 2.9) as CPU builds;
    on a TPU, a libtpu that does not fit brings ``torch_xla[tpu]`` and its pinned libtpu.
    Returns ``(target set, {distribution: (installed or None, requirement)}, reasons)``."""
    pair = matched_set(torch_v, xla_v)
    target = pair or SUPPORTED.get(".".join(_base(torch_v or "").split(".")[:2]), SUPPORTED["2.9"])
    changes: dict[str, tuple[str | None, str]] = {}
    reasons = []
    if pair is None:
        pairs = ", ".join(f"torch {s.torch} + torch_xla {'/'.join(s.torch_xla)}"
                          for s in SUPPORTED.values())
        reasons.append(
            f"torch{' and torch_xla are' if xla_v is None else ' is'} not installed"
            if torch_v is None else
            f"torch {torch_v} has no torch_xla release (supported pairs: {pairs})"
            if _base(torch_v) != target.torch else
            f"torch_xla is not installed (torch {torch_v} is)" if xla_v is None else
            f"torch {torch_v} does not match torch_xla {xla_v} (they must be the same release)")
        if torch_v is None or _base(torch_v) != target.torch:
            changes["torch"] = (torch_v, f"torch=={target.torch}+cpu")
        if xla_v is None or _base(xla_v) not in target.torch_xla:
            changes["torch-xla"] = (xla_v, f"torch_xla=={target.torch_xla[0]}")
    xla_after = target.torch_xla[0] if "torch-xla" in changes else _base(xla_v or "")
    if tpu and not f"{libtpu_v}.".startswith(f"{target.libtpu}."):  # 0.0.21.1 fits 0.0.21
        reasons.append(f"libtpu is missing and torch_xla {xla_after} needs libtpu {target.libtpu}"
                       if libtpu_v is None else
                       f"libtpu {libtpu_v} does not fit torch_xla {xla_after}, which was built "
                       f"against libtpu {target.libtpu} (another one fails with a PJRT API "
                       "mismatch)")
        if "torch-xla" in changes:  # the tpu extra brings the pinned libtpu
            changes["torch-xla"] = (xla_v, f"torch_xla[tpu]=={target.torch_xla[0]}")
        changes["libtpu"] = (libtpu_v, f"libtpu=={target.libtpu}")
    return target, changes, reasons


def version_problems(tpu: bool | None = None,
                     versions: Mapping[str, str | None] | None = None) -> list[str]:
    """Each problem with torch / torch_xla / libtpu, as one sentence with the exact fix.
    ``versions`` replaces the installed ones; ``tpu`` (libtpu needed): default, a TPU is here."""
    tpu = tpu_chips()[0] > 0 if tpu is None else tpu
    v = versions if versions is not None else {d: installed(d)
                                               for d in ("torch", "torch_xla", "libtpu")}
    _, changes, reasons = version_fix(v.get("torch"), v.get("torch_xla"), v.get("libtpu"), tpu)
    reqs = [req for _, req in changes.values()]
    cmd = pip_command(reqs, ["--extra-index-url", CPU_INDEX] if any("+cpu" in r for r in reqs)
                      else [])
    return [f"{r}: run `{cmd}` and restart the runtime." for r in reasons]


def check_versions(tpu: bool | None = None) -> dict[str, str | None]:
    """Return the installed versions, or raise :class:`EnvironmentProblem` on a mismatch."""
    problems = version_problems(tpu)
    if problems:
        raise EnvironmentProblem(" ".join(problems))
    return {d: installed(d) for d in ("torch", "torch_xla", "libtpu")}


def runtime_initialized() -> bool:
    """True if this process has already started the XLA runtime (without starting it)."""
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla  # already imported (checked above): free, and keeps this import light
    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def configure_emulation(num_devices: int = 1, environ: MutableMapping[str, str] | None = None,
                        runtime: Runtime | None = None) -> Runtime:
    """Make a machine without TPU stand in for one: ``PJRT_DEVICE=CPU`` with ``num_devices``
    (4 for SPMD, 1 with ``torch_xla.launch``), before anything touches the device; a no-op on a
    TPU. Raises :class:`EnvironmentProblem` if the runtime already runs with other settings."""
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
                "restart the kernel and run the config cell before anything touches the device.")
        return rt
    env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(num_devices)})
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # XLA's C++ INFO lines are noise; warnings show
    return rt


def report() -> str:
    """A short human-readable report of this machine (``python -m tpu_helpers.env``)."""
    rt = detect_runtime()
    lines = [rt.summary()]
    lines += [f"  {d:10s} {installed(d) or '-'}" for d in ("torch", "torch_xla", "libtpu")]
    lines += [f"  problem: {p}" for p in version_problems(tpu=rt.has_tpu)] or ["  versions: OK"]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        print(report())
    except EnvironmentProblem as exc:
        print(f"EnvironmentProblem: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
