"""The notebooks' setup cell: keep or install a matched torch / torch_xla set (course only).

Every notebook's generated setup cell (``scripts/notebook_template.py``) calls
:func:`setup_notebook`; ``notebooks/00_environment.ipynb`` explains what it does. It builds on
the toolkit's ``tpu_helpers.env`` (runtime detection and :func:`tpu_helpers.env.version_fix`,
the torch / torch_xla / libtpu decision) and adds what only the course needs: the pair in use
and its install command (:func:`install_command`: notebooks 06 and 08, the README), the
platform's companions (torchvision, torchaudio, jax), the notebook packages, the pip run on Colab
and Kaggle, a library check in a fresh process afterwards (on the CPU), and, on a TPU host, a check
that the TPU opens, in a child process (:func:`check_tpu_opens`).

:func:`plan_setup` decides, as pure data, what the setup installs on each platform;
:func:`setup_notebook` carries the plan out and :func:`verify_environment` checks the result.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from tpu_helpers.env import (
    CPU_INDEX,
    SUPPORTED,
    EnvironmentProblem,
    MatchedSet,
    Runtime,
    detect_runtime,
    installed,
    matched_set,
    pip_command,
    runtime_initialized,
    tpu_chips,
    version_fix,
)

#: Variables Kaggle's TPU images set for their own launcher; they confuse torch_xla.launch.
KAGGLE_LAUNCHER_VARS = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")
#: Packages (distribution name -> pip requirement) the notebooks need beyond torch/torch_xla;
#: installed on Colab/Kaggle only when missing, or older than a ``>=`` floor given here.
NOTEBOOK_PACKAGES = {
    "lightning": "lightning==2.6.6",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "pillow": "pillow",
    "psutil": "psutil",
    # Notebook 11. Its sentences are read from, and its cells checked with, transformers 5.24.0
    # and accelerate 1.15.0 (requirements-common.txt): an older copy is upgraded, a newer one
    # kept. Colab's TPU runtime ships transformers 5.15.0 and accelerate 1.14.0
    # (googlecolab/backend-info pip-freeze.tpu.txt, 2026-08), so both are upgraded there;
    # Kaggle's TPU image installs both unpinned (Kaggle/docker-python tpu/requirements.in).
    # transformers 5 needs Python >= 3.11: Colab has 3.13, Kaggle 3.12.
    "transformers": "transformers>=5.24.0",
    "accelerate": "accelerate>=1.15.0",
    "peft": "peft>=0.21.2",  # notebook 14 (LoRA); Colab's TPU image has none (same freeze)
}
#: Libraries whose version must match torch, if the platform ships them: per supported line
#: (``tpu_helpers.env.SUPPORTED``), the release built for that torch.
COMPANION_VERSIONS = {"2.9": {"torchvision": "0.24.0", "torchaudio": "2.9.0"},
                      "2.8": {"torchvision": "0.23.0", "torchaudio": "2.8.0"}}
COMPANIONS = ("torchvision", "torchaudio")
#: Every distribution :func:`plan_setup` looks at.
TRACKED = ("torch", "torch-xla", "libtpu", *COMPANIONS, "jax", "jaxlib", *NOTEBOOK_PACKAGES)
_HEAVY = ("torch", "torch-xla", "libtpu", *COMPANIONS)
_PLATFORM_NAMES = {"colab": "Colab", "kaggle": "Kaggle", "tpu-vm": "this TPU VM",
                   "local": "this machine"}
#: Where to pick a TPU by hand when a notebook opened without one.
TPU_MENUS = ("Colab: Runtime > Change runtime type > v5e-1 TPU; "
             "Kaggle: Settings > Accelerator > TPU VM v5e-8, and Settings > Internet on")
#: What the setup says when this kernel already used the XLA device in an earlier run.
RERUN_SENTENCE = ("This kernel already started the XLA runtime in an earlier run and the notebook "
                  "needs a fresh one: restart the kernel (Kernel > Restart; on Colab Runtime > "
                  "Restart session) and run all.")


#: The Kaggle dataset that carries this package and the wheels Kaggle's TPU image lacks, for
#: notebooks run with Internet off (``make kaggle-dataset``; README "Kaggle with Internet off").
WHEELS_DATASET = "tpu-notebooks-wheels"
#: Environment variable naming the wheels (a glob of this package's wheel: its folder is the
#: ``--find-links`` folder); the default looks in every dataset attached on Kaggle.
WHEELS_VAR = "TPU_NB_WHEELS"
WHEELS_GLOB = "/kaggle/input/*/tpu_helpers-*.whl"
#: Exactly what to attach when there is neither Internet nor the wheels dataset.
ATTACH = (f"No Internet here (Kaggle: Settings > Internet is off) and no wheels dataset "
          f"attached: attach the dataset {WHEELS_DATASET} (in the notebook's right-hand panel, "
          f"Input > Add Input, search {WHEELS_DATASET}, click +; to make it yourself: "
          f"`make kaggle-dataset`, README section \"Kaggle with Internet off\"), or switch "
          f"Settings > Internet on; then run this setup cell again.")
#: Seconds the Internet probe waits for the package index to answer.
PROBE_TIMEOUT = 5.0


def wheels_folder(environ: Mapping[str, str] | None = None) -> str | None:
    """The folder of an attached wheels dataset (the one holding this package's wheel), or None.

    Looks where ``$TPU_NB_WHEELS`` points (a glob), by default ``/kaggle/input/*/``: the folder
    Kaggle mounts each attached dataset at. Reads the file system only."""
    import glob

    pattern = (environ if environ is not None else os.environ).get(WHEELS_VAR, WHEELS_GLOB)
    found = sorted(glob.glob(pattern))
    return os.path.dirname(found[-1]) if found else None


def index_reachable(environ: Mapping[str, str] | None = None,
                    timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether pip's package index answers, within ``timeout`` seconds (the Internet probe).

    One HEAD request for the index page of ``pip`` at ``$PIP_INDEX_URL`` (default PyPI): any
    answer but 2xx/3xx, a refused connection, a failed name lookup (Kaggle with Internet off) or
    no answer in time means no. Costs one round trip where the Internet is on."""
    import urllib.error
    import urllib.request

    env = environ if environ is not None else os.environ
    index = env.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{index}/pip/", method="HEAD"),
                                    timeout=timeout):
            return True
    except (OSError, ValueError):  # URLError, HTTPError, timeouts; ValueError: a bad URL
        return False


def pop_kaggle_launcher_vars(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove Kaggle's launcher variables if present (guarded); return the ones removed."""
    env = os.environ if environ is None else environ
    return [k for k in KAGGLE_LAUNCHER_VARS if env.pop(k, None) is not None]


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: ``5.24.0.dev0`` -> (5, 24, 0)."""
    out = []
    for part in _base(version).split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        out.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(out)


def _too_old(have: str, requirement: str) -> bool:
    """Whether ``have`` is below the ``>=`` floor of ``requirement`` (no floor: never)."""
    floor = re.search(r">=\s*([\w.]+)", requirement)
    return bool(floor) and have != "?" and _release(have) < _release(floor.group(1))


def _norm(name: str) -> str:
    return name.replace("_", "-").replace(".", "-").lower()


def _base(version: str) -> str:
    return version.split("+")[0]


def active_set() -> MatchedSet:
    """The supported set of the installed pair, else the set a setup here would install."""
    return version_fix(installed("torch"), installed("torch_xla"), None, False)[0]


_ACTIVE = active_set()
#: The supported pair in use here: the installed one if supported, else the default (2.9).
TORCH_VERSION = _ACTIVE.torch
TORCH_XLA_VERSION = next((v for v in _ACTIVE.torch_xla
                          if _base(installed("torch_xla") or "") == v), _ACTIVE.torch_xla[0])
LIBTPU_VERSION = _ACTIVE.libtpu  # the one ``torch_xla[tpu]==TORCH_XLA_VERSION`` pins


def install_command(tpu: bool = True, version: str | None = None) -> str:
    """The pip command that installs a matched CPU-build pair (default: the one in use here)."""
    s = SUPPORTED[version] if version else _ACTIVE
    xla = s.torch_xla[0] if version else TORCH_XLA_VERSION
    return pip_command([f"torch=={s.torch}+cpu", f"torch_xla{'[tpu]' if tpu else ''}=={xla}"],
                       ["--extra-index-url", CPU_INDEX])


def installed_versions() -> dict[str, str | None]:
    """Installed version (or None) of every distribution the setup looks at (metadata only)."""
    importlib.invalidate_caches()
    return {d: installed(d) for d in TRACKED}


def _companion_command(comp: str, s: MatchedSet) -> str:
    return pip_command([f"{comp}=={COMPANION_VERSIONS[s.name][comp]}+cpu"],
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
        return pip_command([f"'{r}'" if re.search(r"[<>]", r) else r for r in reqs],
                           self.pip_args)  # a shell reads > as a redirection


def _decide(inst: Mapping[str, str], has_tpu: bool
            ) -> tuple[MatchedSet, dict[str, tuple[str | None, str]], list[str], list[str],
                       list[str]]:
    """:func:`plan_setup`'s decisions: ``(target, changes, reasons, kept, notes)``.

    torch / torch_xla / libtpu as the toolkit decides (:func:`tpu_helpers.env.version_fix`);
    companions follow torch only if installed, in install order after torch."""
    torch_v, xla_v = inst.get("torch"), inst.get("torch-xla")
    target, fixes, reasons = version_fix(torch_v, xla_v, inst.get("libtpu"), has_tpu)
    pair = matched_set(torch_v, xla_v)
    changes = {k: v for k, v in fixes.items() if k == "torch"}
    notes: list[str] = []
    for comp in COMPANIONS:
        want, have = COMPANION_VERSIONS[target.name][comp], inst.get(comp)
        if have is None or _base(have) == want:
            continue
        if pair is None:  # the set changes: the companion follows torch, as a CPU build
            changes[comp] = (have, f"{comp}=={want}+cpu")
        elif have != "?":
            notes.append(f"{comp} {have} is not the {want} built for torch {target.torch}; it "
                         f"is left alone (these notebooks do not use it); if you need it: "
                         f"{_companion_command(comp, target)}")
    changes.update({k: v for k, v in fixes.items() if k != "torch"})
    kept = [f"torch {torch_v} and torch_xla {xla_v} (a supported matched pair)"] if pair else []
    if has_tpu and "libtpu" not in changes:
        xla_after = target.torch_xla[0] if "torch-xla" in changes else _base(xla_v or "")
        kept.append(f"libtpu {inst.get('libtpu')} (fits torch_xla {xla_after})")
    for dist in ("jax", "jaxlib"):
        if dist in inst:
            shown = "(version not listed)" if inst[dist] == "?" else inst[dist]
            warn = " (the notebooks do not use it; it may warn about the new libtpu)"
            kept.append(f"{dist} {shown}" + (warn if "libtpu" in changes else ""))
    return target, changes, reasons, kept, notes


def plan_setup(installed: Mapping[str, str | None], platform: str, has_tpu: bool,
               torch_imported: bool, wheels: str | None = None) -> SetupPlan:
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
    A notebook package is installed when missing or older than its ``>=`` floor
    (:data:`NOTEBOOK_PACKAGES`). ``wheels``: the folder of an attached wheels dataset
    (:func:`wheels_folder`); pip then installs from it alone (``--no-index --find-links``).
    """
    inst = {_norm(k): v for k, v in installed.items() if v}
    target, changes, reasons, kept, notes = _decide(inst, has_tpu)
    heavy = [req for _, req in changes.values()]
    pip_args = ["--extra-index-url", CPU_INDEX] if any("+cpu" in r for r in heavy) else []
    if wheels:
        pip_args = ["--no-index", "--find-links", wheels]
    where = _PLATFORM_NAMES.get(platform, platform)
    installs_here = platform in ("colab", "kaggle")
    light = [req for dist, req in NOTEBOOK_PACKAGES.items()
             if dist not in inst or _too_old(inst[dist], req)]
    old = [f"{d} {inst[d]}" for d, req in NOTEBOOK_PACKAGES.items() if req in light and d in inst]
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
                     if CPU_INDEX in pip_args else "") + f".{stay}")
    else:
        before = f"On {where}: nothing heavy to install.{stay}"
    if light:
        before += f" Notebook packages it lacks: {', '.join(light)}"
        before += f" (older here: {', '.join(old)})." if old else "."
    if wheels:
        before += f" From the wheels in {wheels} only (no package index)."
    return SetupPlan(target, heavy + light, pip_args, before, False, [], changes, notes)


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


def _failures(out: str, err: str, code: int) -> dict[str, str]:
    """Read the check's START/OK/FAIL lines: library -> what failed."""
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
    return failed


def verify_environment(extra_env: Mapping[str, str] | None = None,
                       timeout: float = 600) -> list[str]:
    """Import and run one op of torch, torch_xla and each companion present, in a fresh process.

    Returns one sentence per library that failed, naming it and the fix (empty: all work).
    The XLA op runs on the XLA:CPU device (``PJRT_DEVICE=CPU``), so it never holds the TPU; jax
    runs with ``JAX_PLATFORMS=cpu``. It therefore cannot see whether libtpu opens the TPU (a
    libtpu / PJRT API mismatch): :func:`check_tpu_opens` does that, on a TPU host.
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
    return [f"{lib}: {why}; fix: {_verify_fix(lib, s)}."
            for lib, why in _failures(out, err, code).items()]


_TPU_CHECK = r"""
import torch, torch_xla
assert torch.ones(2, device=torch_xla.device()).add(1).cpu().sum().item() == 4.0
print("TPU-OK", flush=True)
"""
#: stderr of a TPU that failed to open -> what it means (checked in this order).
_TPU_CAUSES = (
    (r"PJRT[ _]?API|PJRT_Api|PJRT plugin|Unexpected PJRT_|later version than the framework",
     "a PJRT API mismatch: this libtpu was not built for this torch_xla"),
    (r"libtpu not found|Failed to open .*libtpu|GetPjrtApi not found|No module named '?libtpu",
     "libtpu could not be loaded"),
    (r"already in use|TPU in use|libtpu_lockfile|[Dd]evice or resource busy",
     "another process holds the TPU"),
)
_ERROR_LINE = re.compile(r"Error|error|Check failed|F\d{4} |Mismatched|Unexpected|not found")


def _stderr_summary(err: str, pattern: str | None) -> str:
    """The line of a failed child's stderr that says what went wrong (at most 300 characters):
    the Python exception that shows the cause, else the first line that does, else the last
    Python exception, else the last error line."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    cause = [ln for ln in lines if pattern and re.search(pattern, ln)]
    python = [ln for ln in lines if re.match(r"\w+(Error|Exception): ", ln)]
    hits = [ln for ln in lines if _ERROR_LINE.search(ln) and not ln.startswith("File ")]
    both = [ln for ln in python if ln in cause]
    return (both[-1:] or cause[:1] or python[-1:] or hits[-1:] or lines[-1:]
            or ["no error message"])[0][:300]


def _tpu_problem(err: str, code: int | None, timeout: float) -> str:
    """One sentence: why the TPU did not open, and the fix."""
    s, libtpu, xla = active_set(), installed("libtpu"), installed("torch_xla")
    pinned = (f"torch_xla[tpu]=={_base(xla or s.torch_xla[0])} pins libtpu=={s.libtpu}: run "
              f"`pip install libtpu=={s.libtpu}` and restart the runtime")
    if code is None:
        return (f"The TPU did not open within {timeout:.0f} s in a child process "
                f"(PJRT_DEVICE=TPU, one op; stopped): another process may hold it, or libtpu "
                f"hangs while starting. Restart the runtime and run this cell again; if it "
                f"persists, check the versions (libtpu {libtpu or 'missing'}; {pinned}).")
    pattern, cause = next(((pat, why) for pat, why in _TPU_CAUSES if re.search(pat, err)),
                          (None, None))
    fix = ("stop it (restart the runtime; on a VM end the other Python process), then run this "
           "cell again" if cause == "another process holds the TPU" else pinned)
    return (f"The TPU did not open in a child process (PJRT_DEVICE=TPU, one op; exit {code}): "
            f"{cause or 'an error'} ({_stderr_summary(err, pattern)}). With libtpu "
            f"{libtpu or 'missing'} and torch_xla {xla or 'missing'}: {fix}.")


def check_tpu_opens(extra_env: Mapping[str, str] | None = None,
                    timeout: float = 300) -> list[str]:
    """Open the TPU in a child process (``PJRT_DEVICE=TPU``), run one op, and let it go.

    The only check that sees a libtpu / PJRT API mismatch (the library check runs on XLA:CPU).
    The chips are held only while the child runs, so the kernel can open them afterwards; the
    child is stopped after ``timeout`` seconds. Returns one sentence with the fix if the TPU
    did not open (empty: it works). Call it only on a TPU host, before the kernel opens it.
    """
    env = {**os.environ, "PJRT_DEVICE": "TPU", **(extra_env or {})}
    for k in (*KAGGLE_LAUNCHER_VARS, "CPU_NUM_DEVICES"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-c", _TPU_CHECK], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group: stopped with its children
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torch's import starts compile workers: them too
        proc.communicate()
        return [_tpu_problem("", None, timeout)]
    if proc.returncode == 0 and "TPU-OK" in out:
        return []
    return [_tpu_problem(err + out, proc.returncode, timeout)]


#: What the setup says where it cannot check the TPU.
NO_TPU_CHECK = ("No TPU here, so nothing checked that libtpu opens one: a libtpu / PJRT API "
                "mismatch shows only on a TPU, where this cell opens it once in a child process.")


# --------------------------------------------------------------------------- the setup cell


def _pip(plan: SetupPlan) -> None:
    """Run the plan's pip install; on failure raise with pip's error tail and the manual command."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", *plan.pip_args, *plan.install],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])[-800:]
        raise EnvironmentProblem(
            f"pip failed, so the environment may be half changed and nothing was checked: {tail} "
            f"Fix the cause (on Kaggle: Settings > Internet on, or attach the dataset "
            f"{WHEELS_DATASET}: README \"Kaggle with Internet off\"), then run `{plan.command}`, "
            "restart the runtime and run this setup cell again."
        )


def _install(plan: SetupPlan, rt: Runtime, before: dict[str, str | None]) -> None:
    """Carry out an install plan, say what changed, and check the result (or raise)."""
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


class _NoJaxNotice(logging.Filter):
    """Drops torch_xla 2.8's "You are trying to use a feature that requires jax/pallas" notice.
    Without jax installed, 2.8 logs it on Python's root logger at every profiler trace (which
    ``pl.MpDeviceLoader``'s threads enter per batch, and ``xp.Trace`` per step) and every
    ``xs.mark_sharding`` (``torch_xla/_internal/jax_workarounds.py``, v2.8.0); 2.9 asks without
    logging (``maybe_get_jax(log=False)``). Nothing the course runs needs jax."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires jax/pallas" not in record.getMessage()


def quiet_jax_notice() -> None:
    """Install :class:`_NoJaxNotice` on the root logger, once (forked replicas inherit it)."""
    root = logging.getLogger()
    if not any(isinstance(f, _NoJaxNotice) for f in root.filters):
        root.addFilter(_NoJaxNotice())


def quiet_tqdm_notice() -> None:
    """Hide tqdm's "IProgress not found" warning: ``tqdm.auto`` (imported by transformers, and
    so by torchmetrics under Lightning) gives it where ipywidgets is missing, as in CI; Colab
    and Kaggle have ipywidgets. tqdm then draws text bars, which is all it means."""
    warnings.filterwarnings("ignore", message="IProgress not found")


def setup_notebook(install: bool = True, quiet: bool = False, check_tpu: bool = True) -> Runtime:
    """The notebooks' setup cell: idempotent, quiet, and it never breaks the platform.

    * Colab / Kaggle: keeps a supported matched torch / torch_xla pair (2.8 or 2.9; see
      :func:`plan_setup`); otherwise installs a matched CPU-build set, saying what it will change
      before and what changed after, then checks it in a fresh process
      (:func:`verify_environment`). Installs missing notebook packages; pops Kaggle's launcher
      variables (guarded).
    * TPU VM / local: installs nothing; raises :class:`EnvironmentProblem` with the fix if
      torch / torch_xla are missing or mismatched.
    * Installs come from an attached wheels dataset if there is one (:func:`wheels_folder`,
      ``pip --no-index --find-links``), else from the package index; with neither the index
      answering within :data:`PROBE_TIMEOUT` s nor the dataset, it raises with exactly what to
      attach (:data:`ATTACH`) before pip runs.
    * On a TPU host (``check_tpu``): opens the TPU once in a child process
      (:func:`check_tpu_opens`) and raises with the fix if it does not open; without a TPU it
      says that this could not be checked (:data:`NO_TPU_CHECK`).
    * A kernel that already used the XLA device (a second "run all") is told to restart.
    * torch_xla 2.8's per-call "requires jax/pallas" log line is filtered
      (:func:`quiet_jax_notice`), and tqdm's "IProgress not found" (:func:`quiet_tqdm_notice`).
    """
    if runtime_initialized():
        raise EnvironmentProblem(RERUN_SENTENCE)
    quiet_jax_notice()
    quiet_tqdm_notice()
    rt = detect_runtime()
    if rt.platform == "kaggle":
        pop_kaggle_launcher_vars()
    before = installed_versions()
    wheels = wheels_folder()
    plan = plan_setup(before, rt.platform, rt.has_tpu, torch_imported="torch" in sys.modules,
                      wheels=wheels)
    if not install or rt.platform not in ("colab", "kaggle"):
        if plan.problems:
            raise EnvironmentProblem(" ".join(plan.problems))
    elif plan.restart_needed:
        raise EnvironmentProblem(plan.before)
    elif plan.install:
        if wheels is None and not index_reachable():
            raise EnvironmentProblem(f"{plan.before} {ATTACH}")
        _install(plan, rt, before)
    for note in plan.notes:
        print(f"Note: {note}")
    tpu_problems = check_tpu_opens() if check_tpu and rt.has_tpu else []
    if tpu_problems:
        raise EnvironmentProblem(" ".join(tpu_problems))
    if not quiet:
        print(f"{rt.summary()}. torch {installed('torch')}, torch_xla {installed('torch_xla')}.")
        if rt.platform in ("colab", "kaggle") and not rt.has_tpu:
            print(f"No TPU attached; to get one: {TPU_MENUS}.")
        print("The TPU opened in a child process (one op) and was released." if check_tpu
              and rt.has_tpu else NO_TPU_CHECK)
    return rt


def pod_command(pod: str, files: list[str], run: str, zone: str = "us-west4-a",
                version: str | None = None) -> str:
    """The two ``gcloud`` commands that copy ``files`` to every worker of TPU pod ``pod`` and
    run ``run`` there after installing the matched pair as a TPU VM needs it:
    :func:`install_command` (``torch==X+cpu`` from PyTorch's CPU index and
    ``torch_xla[tpu]==X``; plain ``torch==X`` from the package index is the CUDA build)."""
    gcloud = f"gcloud compute tpus tpu-vm {{}} --zone={zone} --worker=all"
    install = install_command(tpu=True, version=version).replace("'", '"')  # inside '...'
    return (f"{gcloud.format('scp ' + ' '.join(files) + ' ' + pod + ':')}\n"
            f"{gcloud.format('ssh ' + pod)} --command='\n  {install} -q &&\n  {run}'")
