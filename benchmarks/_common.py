"""What every benchmark command shares: when to run the short (CI-sized) version."""

from __future__ import annotations

import os


def quick_mode(requested: bool) -> bool:
    """True for ``--quick``, and under CI (``CI=true``) or a smoke run (``SMOKE=1``)."""
    return requested or os.environ.get("CI") == "true" or os.environ.get("SMOKE") == "1"
