"""Where am I running, and is it set up right? Runtime detection and local TPU emulation.

Taught in ``notebooks/00_environment.ipynb``; every notebook's setup cell calls
:func:`setup_notebook` and its config cell calls :func:`configure_emulation`.

Nothing here initialises the XLA runtime or touches an XLA device: detection reads
environment variables, ``/sys/bus/pci`` (the same source ``torch_xla._internal.tpu`` uses)
and package metadata only, so calling it never breaks a later ``torch_xla.launch``.

Versions: :data:`SUPPORTED` lists the matched sets (torch_xla 2.9 as on Colab, 2.8 as on
Kaggle). :func:`plan_setup` decides, as pure data, what the setup installs on each platform;
:func:`setup_notebook` carries the plan out and :func:`verify_environment` checks the result in
a fresh process.

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


@dataclass(frozen=True)
class MatchedSet:
    """One supported release line: a torch / torch_xla pair and what must match it.

    torch and torch_xla must be the same release. torchvision and torchaudio pin the exact
    torch they were built for. ``torch_xla[tpu]`` pins ``libtpu``; a platform build of that
    libtpu (Colab's ``0.0.21.1``) fits too.
    """

    name: str
    torch: str
    #: Accepted torch_xla releases for this torch; the first is the one installed.
    torch_xla: tuple[str, ...]
    libtpu: str
    torchvision: str
    torchaudio: str

    def fits_libtpu(self, version: str | None) -> bool:
        return version is not None and (version == self.libtpu
                                        or version.startswith(self.libtpu + "."))


#: The supported matched sets (torch_xla 2.9.0 is the last release; Kaggle ships 2.8).
SUPPORTED: dict[str, MatchedSet] = {
    "2.9": MatchedSet("2.9", torch="2.9.0", torch_xla=("2.9.0",), libtpu="0.0.21",
                      torchvision="0.24.0", torchaudio="2.9.0"),
    "2.8": MatchedSet("2.8", torch="2.8.0", torch_xla=("2.8.0", "2.8.1"), libtpu="0.0.17",
                      torchvision="0.23.0", torchaudio="2.8.0"),
}
#: What gets installed when no supported torch is present.
DEFAULT_SET = "2.9"
#: PyTorch's own index of CPU builds (``torch==2.9.0+cpu``); Colab and Kaggle can reach it.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Packages (distribution name -> pip requirement) the notebooks need beyond torch/torch_xla;
#: installed on Colab/Kaggle only when missing.
NOTEBOOK_PACKAGES = {
    "lightning": "lightning==2.6.6",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "pillow": "pillow",
    "psutil": "psutil",
}
#: Libraries whose version must match torch, if the platform ships them.
COMPANIONS = ("torchvision", "torchaudio")
#: Every distribution :func:`plan_setup` looks at.
TRACKED = ("torch", "torch-xla", "libtpu", *COMPANIONS, "jax", "jaxlib", *NOTEBOOK_PACKAGES)
_HEAVY = ("torch", "torch-xla", "libtpu", *COMPANIONS)
_PLATFORM_NAMES = {"colab": "Colab", "kaggle": "Kaggle", "tpu-vm": "this TPU VM",
                   "local": "this machine"}
#: Where to pick a TPU by hand when a notebook opened without one.
TPU_MENUS = ("Colab: Runtime > Change runtime type > v5e-1 TPU; "
             "Kaggle: Settings > Accelerator > TPU VM v5e-8, and Settings > Internet on")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _base(version: str) -> str:
    return version.split("+")[0]


def installed_versions() -> dict[str, str | None]:
    """Installed version (or None) of every distribution the setup looks at (metadata only)."""
    importlib.invalidate_caches()
    return {d: _installed(d) for d in TRACKED}


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
    torch_v, xla_v = _installed("torch"), _installed("torch_xla")
    return matched_set(torch_v, xla_v) or target_set(torch_v)


_ACTIVE = active_set()
#: The supported pair in use here: the installed one if supported, else the default (2.9).
TORCH_VERSION = _ACTIVE.torch
TORCH_XLA_VERSION = next((v for v in _ACTIVE.torch_xla
                          if _base(_installed("torch_xla") or "") == v), _ACTIVE.torch_xla[0])
#: The libtpu that ``torch_xla[tpu]==TORCH_XLA_VERSION`` pins.
LIBTPU_VERSION = _ACTIVE.libtpu


def _quote(req: str) -> str:
    return f"'{req}'" if "[" in req else req


def pip_command(install: list[str], pip_args: list[str] | None = None) -> str:
    """The pip command line a user can paste."""
    return " ".join(["pip install", *map(_quote, install), *(pip_args or [])])


def _companion_command(comp: str, s: MatchedSet) -> str:
    return pip_command([f"{comp}=={getattr(s, comp)}+cpu"], ["--extra-index-url", CPU_INDEX])


def install_command(tpu: bool = True, version: str | None = None) -> str:
    """The exact pip command that installs a matched CPU-build pair (``version``: 2.8 or 2.9;
    default: the pair in use here)."""
    s = SUPPORTED[version] if version else _ACTIVE
    xla = s.torch_xla[0] if version else TORCH_XLA_VERSION
    return pip_command([f"torch=={s.torch}+cpu",
                        f"torch_xla[tpu]=={xla}" if tpu else f"torch_xla=={xla}"],
                       ["--extra-index-url", CPU_INDEX])


@dataclass
class SetupPlan:
    """What :func:`setup_notebook` will do, decided by :func:`plan_setup` (pure data)."""

    target: MatchedSet
    #: pip requirement strings, in install order (empty: install nothing).
    install: list[str]
    pip_args: list[str]
    #: Plain words, printed before anything changes.
    before: str
    #: torch is imported in this kernel and would change: nothing is installed, restart first.
    restart_needed: bool = False
    #: One sentence per problem, each with its fix (raised where nothing is installed).
    problems: list[str] = field(default_factory=list)
    #: distribution -> (installed version or None, requirement that replaces it).
    changes: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    #: Things that stay wrong on purpose but are worth one line (e.g. a mismatched torchvision).
    notes: list[str] = field(default_factory=list)

    @property
    def heavy(self) -> list[str]:
        """The requirements among torch, torch_xla, libtpu, torchvision, torchaudio."""
        return [req for dist, (_, req) in self.changes.items() if dist in _HEAVY]

    @property
    def command(self) -> str:
        """The same install as one pip command to run by hand."""
        reqs = self.install or [req for _, req in self.changes.values()]
        return pip_command(reqs, self.pip_args)


def _shown(version: str) -> str:
    return "(version not listed)" if version == "?" else version


def _describe(torch_v: str | None, xla_v: str | None, target: MatchedSet) -> str:
    if torch_v is None and xla_v is None:
        return "torch and torch_xla are not installed"
    if torch_v is None:
        return "torch is not installed"
    if xla_v is None and _base(torch_v) == target.torch:
        return f"torch_xla is not installed (torch {torch_v} is)"
    if _base(torch_v) != target.torch:
        return (f"torch {torch_v} has no torch_xla release (supported pairs: "
                + ", ".join(f"torch {s.torch} + torch_xla {'/'.join(s.torch_xla)}"
                            for s in SUPPORTED.values()) + ")")
    return f"torch {torch_v} does not match torch_xla {xla_v} (they must be the same release)"


def _decide(inst: Mapping[str, str], torch_v: str | None, xla_v: str | None,
            lib_v: str | None, pair: MatchedSet | None, target: MatchedSet, has_tpu: bool
            ) -> tuple[dict[str, tuple[str | None, str]], list[str], list[str], list[str]]:
    """:func:`plan_setup`'s decisions: ``(changes, reasons, kept, notes)``; ``changes`` maps a
    distribution to ``(installed version, requirement to install)``."""
    changes: dict[str, tuple[str | None, str]] = {}
    reasons: list[str] = []
    kept: list[str] = []
    notes: list[str] = []

    if pair is None:
        reasons.append(_describe(torch_v, xla_v, target))
        if torch_v is None or _base(torch_v) != target.torch:
            changes["torch"] = (torch_v, f"torch=={target.torch}+cpu")
        for comp in COMPANIONS:  # only those already installed, at the build for this torch
            want = getattr(target, comp)
            if comp in inst and _base(inst[comp]) != want:
                changes[comp] = (inst[comp], f"{comp}=={want}+cpu")
        if xla_v is None or _base(xla_v) not in target.torch_xla:
            changes["torch-xla"] = (xla_v, f"torch_xla=={target.torch_xla[0]}")
    else:
        kept.append(f"torch {torch_v} and torch_xla {xla_v} (a supported matched pair)")
        for comp in COMPANIONS:
            want = getattr(target, comp)
            if comp in inst and inst[comp] != "?" and _base(inst[comp]) != want:
                notes.append(f"{comp} {inst[comp]} is not the {want} built for torch "
                             f"{target.torch}; it is left alone (these notebooks do not use it); "
                             f"if you need it: {_companion_command(comp, target)}")
    xla_after = target.torch_xla[0] if "torch-xla" in changes else _base(xla_v or "")
    if has_tpu:
        if target.fits_libtpu(lib_v):
            kept.append(f"libtpu {lib_v} (fits torch_xla {xla_after})")
        else:
            why = (f"libtpu is missing and torch_xla {xla_after} needs libtpu {target.libtpu}"
                   if lib_v is None else
                   f"libtpu {lib_v} does not fit torch_xla {xla_after}, which was built against "
                   f"libtpu {target.libtpu} (another one fails with a PJRT API mismatch)")
            reasons.append(why)
            if "torch-xla" in changes:  # the tpu extra brings the pinned libtpu
                changes["torch-xla"] = (xla_v, f"torch_xla[tpu]=={target.torch_xla[0]}")
            changes["libtpu"] = (lib_v, f"libtpu=={target.libtpu}")
    for dist in ("jax", "jaxlib"):
        if dist in inst:
            warn = " (the notebooks do not use it; it may warn about the new libtpu)"
            kept.append(f"{dist} {_shown(inst[dist])}" + (warn if "libtpu" in changes else ""))
    return changes, reasons, kept, notes


def plan_setup(installed: Mapping[str, str | None], platform: str, has_tpu: bool,
               torch_imported: bool) -> SetupPlan:
    """Decide what the setup cell installs; pure (reads nothing, changes nothing).

    ``installed`` maps distribution names (any spelling: ``torch_xla`` or ``torch-xla``) to
    installed versions (None or absent: not installed; ``"?"``: installed, version unknown).
    ``platform`` is colab, kaggle, tpu-vm or local: only Colab and Kaggle get installs; elsewhere
    the plan only lists the problems with their fix.

    Rules: a supported matched pair (with, on a TPU, a libtpu that fits it) installs nothing
    heavy, only missing notebook packages. Otherwise it installs a matched CPU-build set of the
    installed torch's line (2.8 or 2.9; else 2.9): ``torch==X+cpu`` from PyTorch's CPU index (never
    a CUDA build), torchvision/torchaudio at their matching versions only if already installed,
    torch_xla (``torch_xla[tpu]`` when the TPU's libtpu must come with it). libtpu and jax stay
    unless the pair needs another libtpu. If torch is imported in the kernel and torch, torch_xla
    or a companion must change, nothing is installed and the plan asks for a restart.
    """
    inst = {_norm(k): v for k, v in installed.items() if v}
    torch_v, xla_v, lib_v = inst.get("torch"), inst.get("torch-xla"), inst.get("libtpu")
    pair = matched_set(torch_v, xla_v)
    target = pair or target_set(torch_v)
    where = _PLATFORM_NAMES.get(platform, platform)
    changes, reasons, kept, notes = _decide(inst, torch_v, xla_v, lib_v, pair, target,
                                            has_tpu)
    heavy = [req for _, req in changes.values()]
    pip_args = ["--extra-index-url", CPU_INDEX] if any("+cpu" in r for r in heavy) else []
    installs_here = platform in ("colab", "kaggle")
    light = [req for dist, req in NOTEBOOK_PACKAGES.items() if dist not in inst]
    restart = torch_imported and installs_here and any(
        d in changes for d in ("torch", "torch-xla", *COMPANIONS))

    manual = pip_command(heavy, pip_args)
    problems = [f"{r}: run `{manual}` and restart the runtime." for r in reasons]
    listing = ", ".join(f"{req.split('==')[0]} {old or '(none)'} -> {req.split('==')[1]}"
                        for old, req in changes.values())
    stay = f" Staying as they are: {'; '.join(kept)}." if kept else ""
    if not installs_here:
        before = (f"Nothing is installed on {where} (only on Colab and Kaggle)."
                  + (f" To fix: {'; '.join(reasons)}: run `{manual}`." if reasons else ""))
        return SetupPlan(target, [], pip_args, before, False, problems, changes, notes)
    if restart:
        why = "; ".join(reasons)
        before = (f"{why[:1].upper() + why[1:]}, and torch is already imported in this "
                  f"kernel, so nothing was changed: restart the runtime, then run this setup "
                  f"cell first (it will install {listing}).")
        return SetupPlan(target, [], pip_args, before, True, problems, changes, notes)
    if changes:
        before = (f"On {where}: {'; '.join(reasons)}. This installs the matched torch "
                  f"{target.name} set: {listing}"
                  + (f" (CPU builds from {CPU_INDEX}: a TPU host needs no CUDA)"
                     if pip_args else "") + f".{stay}")
    else:
        before = f"On {where}: nothing heavy to install.{stay}"
    if light:
        before += f" Notebook packages it lacks: {', '.join(light)}."
    return SetupPlan(target, heavy + light, pip_args, before, False, [], changes, notes)


def version_problems(tpu: bool | None = None) -> list[str]:
    """Each problem with torch / torch_xla / libtpu, as one sentence with the exact fix.

    Reads package metadata only (nothing is imported). ``tpu`` says whether libtpu is
    needed; by default it is when a TPU is attached. Any supported matched pair is fine.
    """
    if tpu is None:
        tpu = tpu_chips()[0] > 0
    return plan_setup(installed_versions(), "local", tpu, torch_imported=False).problems


def check_versions(tpu: bool | None = None) -> dict[str, str | None]:
    """Return the installed versions, or raise :class:`EnvironmentProblem` on a mismatch."""
    problems = version_problems(tpu)
    if problems:
        raise EnvironmentProblem(" ".join(problems))
    return {d: _installed(d) for d in ("torch", "torch_xla", "libtpu")}


# --------------------------------------------------------------------------- verification

_VERIFY = r'''
import importlib.util, os, sys

def check(name, what, fn):
    if importlib.util.find_spec(name) is None:
        return
    print("START", name, flush=True)
    try:
        fn()
    except BaseException as exc:
        msg = (str(exc).strip().splitlines() or [""])[-1][:300]
        print("FAIL", name, what, "|", type(exc).__name__ + (": " + msg if msg else ""), flush=True)
    else:
        print("OK", name, flush=True)

def _torch():
    import torch
    assert torch.ones(2).add(1).sum().item() == 4.0

def _torch_xla():
    import torch, torch_xla
    assert torch.ones(2, device=torch_xla.device()).add(1).cpu().sum().item() == 4.0

def _torchvision():
    import torch, torchvision
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    assert torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5).tolist() == [0]

def _torchaudio():
    import torch, torchaudio
    assert torchaudio.functional.gain(torch.ones(1, 4), 0.0).shape == (1, 4)

def _jax():
    import jax
    assert float(jax.numpy.ones(2).sum()) == 2.0

check("torch", "torch.ones(2).add(1)", _torch)
check("torch_xla", "torch.ones(2) on the XLA:CPU device", _torch_xla)
check("torchvision", "torchvision.ops.nms on 2 boxes", _torchvision)
check("torchaudio", "torchaudio.functional.gain", _torchaudio)
check("jax", "jax.numpy.ones(2).sum() on CPU", _jax)
'''


def _verify_fix(lib: str, s: MatchedSet) -> str:
    if lib in ("torch", "torch_xla"):
        return f"run `{install_command(tpu_chips()[0] > 0, s.name)}` and restart the runtime"
    if lib in COMPANIONS:
        return (f"run `{_companion_command(lib, s)}` (the build for torch {s.torch}) or "
                f"`pip uninstall -y {lib}` if you do not need it, then restart the runtime")
    return (f"the notebooks do not use {lib}: `pip uninstall -y jax jaxlib`, or reinstall the "
            "jax that matches this libtpu, then restart the runtime")


def verify_environment(extra_env: Mapping[str, str] | None = None,
                       timeout: float = 600) -> list[str]:
    """Import and run one op of torch, torch_xla and each companion present, in a fresh process.

    Returns one sentence per library that failed, naming it and the fix (empty: all work).
    The XLA op runs on the XLA:CPU device (``PJRT_DEVICE=CPU``), so it never holds the TPU;
    jax runs with ``JAX_PLATFORMS=cpu``.
    """
    env = {**os.environ, "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu",
           "TF_CPP_MIN_LOG_LEVEL": "2", **(extra_env or {})}
    for k in KAGGLE_LAUNCHER_VARS:
        env.pop(k, None)
    try:
        proc = subprocess.run([sys.executable, "-c", _VERIFY], env=env, capture_output=True,
                              text=True, timeout=timeout)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, code = f"no answer after {timeout:.0f} s", -1
    s = active_set()
    failed: dict[str, str] = {}
    started = None
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word == "START":
            started = rest
        elif word == "OK":
            started = None
        elif word == "FAIL":
            name, _, why = rest.partition(" ")
            failed[name] = why.replace(" | ", " failed: ", 1)
            started = None
    if started is not None:  # the process died inside a check (e.g. a crash while loading)
        tail = (err.strip().splitlines() or ["no error message"])[-1][:300]
        failed[started] = f"crashed the process (exit {code}): {tail}"
    elif code != 0 and not failed:
        failed["python"] = f"the check itself failed (exit {code}): {err.strip()[-300:]}"
    return [f"{lib}: {why}; fix: {_verify_fix(lib, s)}." for lib, why in failed.items()]


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

#: What the setup says when this kernel already used the XLA device in an earlier run.
RERUN_SENTENCE = ("This kernel already started the XLA runtime in an earlier run and the notebook "
                  "needs a fresh one: restart the kernel (Kernel > Restart; on Colab Runtime > "
                  "Restart session) and run all.")


def pop_kaggle_launcher_vars(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove Kaggle's launcher variables if present (guarded); return the ones removed."""
    env = os.environ if environ is None else environ
    return [k for k in KAGGLE_LAUNCHER_VARS if env.pop(k, None) is not None]


def _pip(plan: SetupPlan) -> None:
    """Run the plan's pip install; on failure raise with pip's error tail and the manual command."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", *plan.pip_args, *plan.install],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])[-800:]
        raise EnvironmentProblem(
            f"pip failed, so the environment may be half changed and nothing was checked: {tail} "
            f"Fix the cause (on Kaggle: Settings > Internet on), then run `{plan.command}`, "
            "restart the runtime and run this setup cell again."
        )


def setup_notebook(install: bool = True, quiet: bool = False) -> Runtime:
    """The notebooks' setup cell: idempotent, quiet, and it never breaks the platform.

    * Colab / Kaggle: keeps a supported matched torch / torch_xla pair (2.8 or 2.9; see
      :func:`plan_setup`); otherwise installs a matched CPU-build set, saying what it will change
      before and what changed after, then checks it in a fresh process
      (:func:`verify_environment`). Installs missing notebook packages; pops Kaggle's launcher
      variables (guarded).
    * TPU VM / local: installs nothing; raises :class:`EnvironmentProblem` with the fix if
      torch / torch_xla are missing or mismatched.
    * A kernel that already used the XLA device (a second "run all") is told to restart.
    """
    if runtime_initialized():
        raise EnvironmentProblem(RERUN_SENTENCE)
    rt = detect_runtime()
    if rt.platform == "kaggle":
        pop_kaggle_launcher_vars()
    before = installed_versions()
    plan = plan_setup(before, rt.platform, rt.has_tpu, torch_imported="torch" in sys.modules)
    if not install or rt.platform not in ("colab", "kaggle"):
        if plan.problems:
            raise EnvironmentProblem(" ".join(plan.problems))
    elif plan.restart_needed:
        raise EnvironmentProblem(plan.before)
    elif plan.install:
        print(plan.before, flush=True)
        _pip(plan)
        after = installed_versions()
        changed = [f"{d} {before[d] or '-'} -> {after[d] or '-'}" for d in TRACKED
                   if before[d] != after[d]]
        print("Changed: " + (", ".join(changed) if changed else "nothing"), flush=True)
        if plan.heavy:
            failures = verify_environment()
            if failures:
                raise EnvironmentProblem("After the install, " + " ".join(failures))
        problems = plan_setup(after, rt.platform, rt.has_tpu, torch_imported=False).problems
        if problems:
            raise EnvironmentProblem("After the install, " + " ".join(problems))
    for note in plan.notes:
        print(f"Note: {note}")
    if not quiet:
        print(f"{rt.summary()}. torch {_installed('torch')}, torch_xla {_installed('torch_xla')}.")
        if rt.platform in ("colab", "kaggle") and not rt.has_tpu:
            print(f"No TPU attached; to get one: {TPU_MENUS}.")
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
