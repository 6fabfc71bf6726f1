"""Build the Kaggle dataset for notebooks run with Internet off (``make kaggle-dataset``).

Kaggle's code competitions run notebooks with the Internet switched off, where the setup cell
can download neither this repository's package nor the packages Kaggle's TPU image lacks. This
script fills one folder to upload as a Kaggle dataset (``kaggle datasets create -p <folder>``,
or the web page's *New Dataset*), holding:

* this package's wheel (``tpu_helpers-*.whl``: the toolkit, the course code and the data);
* the wheels of every package the notebooks need beyond the platform's own torch / torch_xla /
  libtpu / jax set, for Kaggle's Python (3.12, manylinux x86_64), with their dependencies:
  the package's own dependencies (``pyproject.toml``) and ``course.setup.NOTEBOOK_PACKAGES``.
  Kaggle's TPU image lists most of them without versions (Kaggle/docker-python
  ``tpu/requirements.in``) and lacks ``lightning``, so the folder carries the whole dependency
  closure; pip takes from it only what the image lacks or has too old;
* ``dataset-metadata.json`` (Kaggle's dataset format: ``title``, ``id``, ``licenses``).

Attached to a notebook, the folder appears under ``/kaggle/input/``; the setup cell installs the
package's wheel from it and ``course.setup.setup_notebook`` the rest with
``pip install --no-index --find-links <folder>``.

The closure is resolved here, one ``pip download --no-deps`` per round of new requirements
(``--only-binary=:all:`` for the target Python and platform), reading each wheel's
``Requires-Dist`` with the target's markers, and leaving out the platform's packages
(:data:`PLATFORM`): ``pip download`` with dependencies would fetch torch's CUDA build.

    python scripts/kaggle_dataset.py dist/kaggle-dataset --owner YOUR_KAGGLE_NAME
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from course.setup import NOTEBOOK_PACKAGES, WHEELS_DATASET  # noqa: E402

#: Kaggle's TPU image (Kaggle/docker-python tpu/config.txt: python:3.12, cp312,
#: manylinux_2_28_x86_64 torch wheels).
KAGGLE_PYTHON = "3.12"
KAGGLE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "manylinux_2_5_x86_64", "linux_x86_64")
#: Never downloaded: the platform brings its matched set (course.setup keeps it), and a
#: download from the package index would be torch's CUDA build with gigabytes of CUDA libraries.
PLATFORM = ("torch", "torch-xla", "torchvision", "torchaudio", "libtpu", "jax", "jaxlib",
            "triton")
PLATFORM_PREFIXES = ("nvidia-",)
LICENSE = "Apache 2.0"  # pyproject.toml: Apache-2.0; Kaggle's name for it


def requirements() -> list[str]:
    """What the notebooks need beyond the platform: the package's dependencies, then the
    notebook packages (``course.setup.NOTEBOOK_PACKAGES``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [*project["dependencies"], *NOTEBOOK_PACKAGES.values()]


def marker_env(python_version: str) -> dict[str, str]:
    """The environment markers of the target (CPython on Linux x86_64)."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


def _provided(name: str, provided: set[str]) -> bool:
    name = canonicalize_name(name)
    return name in provided or name.startswith(PLATFORM_PREFIXES)


def _requires(wheel: Path, env: dict[str, str], extras: set[str]) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply to ``env`` (with the requested extras)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8")
    out = []
    for line in text.splitlines():
        if not line:
            break  # the headers end at the first blank line
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e})
                                         for e in extras | {""}):
                req.marker = None  # evaluated here, for this wheel's extras
                out.append(req)
    return out


def _pip_download(reqs: list[str], dest: Path, python_version: str, platforms: tuple[str, ...],
                  pip_args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", *[a for p in platforms for a in ("--platform", p)],
           "-d", str(dest), *pip_args, *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip download failed for {' '.join(reqs)}:\n{proc.stderr[-3000:]}")


def download_closure(reqs: list[str], dest: Path, *, python_version: str = KAGGLE_PYTHON,
                     platforms: tuple[str, ...] = KAGGLE_PLATFORMS,
                     provided: tuple[str, ...] = PLATFORM,
                     pip_args: list[str] | None = None) -> dict[str, Path]:
    """Download wheels of ``reqs`` and all their dependencies into ``dest`` for the target,
    leaving out ``provided`` names (and ``nvidia-*``). Returns name -> wheel."""
    env, skip = marker_env(python_version), {canonicalize_name(n) for n in provided}
    have: dict[str, Path] = {}
    extras: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in reqs]
    while todo:
        fetch: dict[str, Requirement] = {}
        nxt: list[Requirement] = []
        for req in todo:
            name = canonicalize_name(req.name)
            if _provided(name, skip) or (req.marker and not req.marker.evaluate(env)):
                continue
            new_extras = set(req.extras) - extras.get(name, set())
            extras.setdefault(name, set()).update(req.extras)
            if name in have:
                version = parse_wheel_filename(have[name].name)[1]
                if not req.specifier.contains(version, prereleases=True):
                    raise SystemExit(f"{req} conflicts with the {have[name].name} already "
                                     "chosen: pin one version in requirements()")
                if new_extras:  # the wheel is here, the dependencies of its new extras not yet
                    nxt += _requires(have[name], env, new_extras)
            elif name in fetch:
                fetch[name] = Requirement(f"{name}{fetch[name].specifier & req.specifier}")
            else:
                fetch[name] = Requirement(f"{name}{req.specifier}")
        if fetch:
            with tempfile.TemporaryDirectory() as tmp:
                _pip_download([str(r) for r in fetch.values()], Path(tmp), python_version,
                              platforms, pip_args or [])
                for wheel in Path(tmp).glob("*.whl"):
                    name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
                    have[name] = Path(shutil.copy2(wheel, dest / wheel.name))
            missing = set(fetch) - set(have)
            if missing:
                raise SystemExit(f"pip downloaded no wheel for {sorted(missing)}")
            for name in fetch:
                nxt += _requires(have[name], env, extras.get(name, set()))
        todo = nxt
    return have


def build_wheel(dest: Path) -> Path:
    """This package's wheel (as ``make wheel`` builds it), into ``dest``."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "--disable-pip-version-check", "--no-build-isolation", "-w", tmp,
                        str(REPO)], check=True)
        (wheel,) = Path(tmp).glob("tpu_helpers-*.whl")
        return Path(shutil.copy2(wheel, dest / wheel.name))


def metadata(owner: str, slug: str = WHEELS_DATASET) -> dict:
    """``dataset-metadata.json``: Kaggle's dataset format (title, id, licenses)."""
    return {"title": "tpu-notebooks wheels (Kaggle with Internet off)", "id": f"{owner}/{slug}",
            "licenses": [{"name": LICENSE}],
            "subtitle": "The tpu-notebooks package and the wheels Kaggle's image lacks",
            "description": ("Attach to a tpu-notebooks notebook (Add Input) to run it with "
                            "Internet off: its setup cell installs from these wheels with "
                            "pip --no-index --find-links.")}


def build(out: Path, *, owner: str, reqs: list[str] | None = None,
          python_version: str = KAGGLE_PYTHON, platforms: tuple[str, ...] = KAGGLE_PLATFORMS,
          provided: tuple[str, ...] = PLATFORM, pip_args: list[str] | None = None,
          wheel: Path | None = None) -> dict[str, Path]:
    """Fill ``out`` (emptied first): this package's wheel (``wheel``, or built here), the wheel
    closure of ``reqs`` (default :func:`requirements`) and ``dataset-metadata.json``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    own = Path(shutil.copy2(wheel, out / wheel.name)) if wheel else build_wheel(out)
    got = download_closure(requirements() if reqs is None else reqs, out,
                           python_version=python_version, platforms=platforms,
                           provided=provided, pip_args=pip_args)
    (out / "dataset-metadata.json").write_text(json.dumps(metadata(owner), indent=2) + "\n")
    return {"tpu-helpers": own, **got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the folder to fill (emptied first)")
    ap.add_argument("--owner", default="YOUR-KAGGLE-USERNAME",
                    help="your Kaggle user name: the dataset id is OWNER/" + WHEELS_DATASET)
    ap.add_argument("--python-version", default=KAGGLE_PYTHON)
    ap.add_argument("--platform", action="append", dest="platforms",
                    help="wheel platform tags (repeat); default: Kaggle's manylinux x86_64")
    ap.add_argument("--wheel", type=Path, help="this package's wheel, if already built")
    ap.add_argument("--requirement", action="append", dest="reqs",
                    help="what to download instead of the notebooks' packages (repeat)")
    ap.add_argument("--provided", action="append", default=[],
                    help="a package the target already has: never downloaded (repeat; "
                         "added to torch, torch_xla, libtpu, jax, ...)")
    args, pip_args = ap.parse_known_args(argv)  # the rest goes to pip: --find-links, --no-index
    got = build(args.out, owner=args.owner, reqs=args.reqs, python_version=args.python_version,
                platforms=tuple(args.platforms or KAGGLE_PLATFORMS),
                provided=(*PLATFORM, *args.provided), pip_args=pip_args, wheel=args.wheel)
    size = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    print(f"{args.out}: {len(got)} wheels, {size:.0f} MB, for Python {args.python_version}. "
          f"Upload: kaggle datasets create -p {args.out} (set the id's owner in "
          f"dataset-metadata.json first), then in a notebook: Add Input > {WHEELS_DATASET}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
