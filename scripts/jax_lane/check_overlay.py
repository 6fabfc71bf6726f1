"""Refuse a jax-lane overlay that would change a venv: ``check_overlay.py OVERLAY VENV...``.

The overlay (``--no-deps --target``) is put on PYTHONPATH, ahead of the venv's site-packages, so
a package in both would silently replace the venv's (numpy, say). Exit 1 naming every top-level
name the overlay shares with a venv's site-packages; missing venvs are skipped."""

from __future__ import annotations

import sys
from pathlib import Path


def top_level(folder: Path) -> set[str]:
    names = set()
    for p in folder.iterdir():
        if p.name.startswith(".") or p.name in ("__pycache__", "bin"):
            continue
        if p.name.endswith(".dist-info"):
            names.add(p.name.split("-")[0].lower().replace("_", "-") + " (dist)")
        else:
            names.add(p.name.split(".")[0] if p.suffix in (".py", ".so", ".pth") else p.name)
    return names


def main(overlay: str, *venvs: str) -> int:
    mine = top_level(Path(overlay))
    clashes = []
    for venv in venvs:
        for site in Path(venv).glob("lib/python3*/site-packages"):
            shared = sorted(mine & top_level(site))
            clashes += [f"{venv}: {name}" for name in shared]
    if clashes:
        print(f"{overlay} would shadow what the venv has:\n  " + "\n  ".join(clashes))
        return 1
    print(f"{overlay}: {len(mine)} names, none in {', '.join(venvs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
