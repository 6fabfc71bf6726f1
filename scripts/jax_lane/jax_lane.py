"""pytest plugin of the jax lane (``make test-jax``; ``-p jax_lane``).

Colab's and Kaggle's TPU images ship jax (and flax) beside torch_xla, and torch_xla takes other
code paths when jax imports (``requirements-jax-lane.txt`` says which versions). The lane puts
those packages on PYTHONPATH as an overlay (``.jax-overlay``) and runs the notebooks that touch
SPMD, scan, attention or sharding plus the tests of the jax code paths.

At start the plugin imports jax in a fresh process of the same environment (a jax that is on the
path but does not import fails the lane there) and checks the venv's own numpy is the one used.
Each notebook runs in a kernel that nbmake starts; the kernel and every process it starts write
proof files (``scripts/lanes/sitecustomize.py``) into ``$JAX_LANE_DIR/<notebook>/``. After
the notebook ran, the test fails unless its kernel process found jax on its path, and if any of
its processes did not: a lane whose overlay silently dropped out would otherwise pass without
jax. The terminal summary lists, per notebook, the processes and which took the jax path.

The lane's own artifact (not a platform's): on a host without TPU chips jax's backend start sets
``TPU_SKIP_MDS_QUERY=1`` (``jax/_src/cloud_tpu_init.py``, jax 0.7.2), so torch_xla's
``_internal/tpu.py`` ``version()`` then reads ``TPU_ACCELERATOR_TYPE`` (unset: ``TypeError``),
which Lightning 2.6's ``XLAAccelerator.is_available`` does not catch. A TPU host has chips, so
jax leaves the variable alone there. So a notebook that uses Lightning runs WITHOUT jax in this
lane: ``JAX_LANE_WITHOUT`` names such notebooks (stems, separated by spaces); their kernel starts
with the overlay (every ``PYTHONPATH`` entry holding a ``jax`` package) taken off its path, and
the test fails if any of their processes could import jax after all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import json, sys, numpy, jax
print(json.dumps({"jax": jax.__version__, "sum": float(jax.numpy.ones(2).sum()),
                  "numpy": numpy.__version__, "numpy_file": numpy.__file__,
                  "prefix": sys.prefix}))
"""


def _base() -> Path:
    base = os.environ.get("JAX_LANE_DIR")
    if os.environ.get("JAX_LANE") != "1" or not base:
        raise pytest.UsageError("the jax lane needs JAX_LANE=1 and JAX_LANE_DIR (and scripts/"
                                "lanes, scripts/jax_lane and the jax overlay on PYTHONPATH)")
    return Path(base)


def proofs(folder: Path) -> list[dict]:
    """The proof records of the processes that wrote into ``folder``."""
    out = []
    for p in sorted(folder.glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def is_kernel(record: dict) -> bool:
    return any("ipykernel" in str(a) for a in record.get("argv", []))


def without_jax(records: list[dict]) -> str | None:
    """Why a notebook run without jax did have it (None: none of its processes could import it)."""
    found = [r for r in records if r.get("jax_origin")]
    if found:
        return (f"jax was importable in {len(found)} process(es) of a notebook run without it: "
                f"{found[0]['jax_origin']}")
    return None


#: What jax's backend start writes into os.environ (jax/_src/cloud_tpu_init.py, jax 0.7.2). A test
#: of the lane that runs jax in the pytest worker leaves them there, and a notebook's kernel would
#: inherit them: each notebook starts without those the worker did not have at its start.
JAX_ENV = ("TPU_SKIP_MDS_QUERY", "GRPC_VERBOSITY", "TPU_ML_PLATFORM", "TPU_ML_PLATFORM_VERSION",
           "ENABLE_RUNTIME_UPTIME_TELEMETRY", "LIBTPU_INIT_ARGS",
           "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES")
_START_ENV = {k: os.environ.get(k) for k in JAX_ENV}


def _without(name: str) -> bool:
    return name in os.environ.get("JAX_LANE_WITHOUT", "").split()


def _path_without_jax() -> str:
    return os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p and not os.path.isdir(os.path.join(p, "jax")))


def verdict(records: list[dict]) -> str | None:
    """Why a notebook's processes do not prove jax was importable (None: they do)."""
    kernels = [r for r in records if is_kernel(r)]
    if not kernels:
        return (f"no proof file from the notebook's kernel ({len(records)} other process(es)): "
                "was scripts/lanes on the kernel's PYTHONPATH?")
    missing = [r for r in records if not r.get("jax_origin")]
    if missing:
        who = ", ".join(f"pid {r['pid']} {' '.join(map(str, r['argv']))[:80]}" for r in missing)
        return f"jax was not importable in {len(missing)} process(es): {who}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    _base()
    if hasattr(config, "workerinput"):  # xdist worker: the controller checked already
        return
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_LANE_DIR": ""})
    if proc.returncode != 0:
        raise pytest.UsageError(f"the jax lane: jax does not import here:\n{proc.stderr[-2000:]}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    if not info["numpy_file"].startswith(info["prefix"]):
        raise pytest.UsageError(f"the jax lane: numpy {info['numpy']} comes from "
                                f"{info['numpy_file']}, not the venv: the overlay shadows it")
    config._jax_lane_info = info


def pytest_report_header(config: pytest.Config) -> str | None:
    info = getattr(config, "_jax_lane_info", None)
    if info:
        return (f"jax lane: jax {info['jax']} imports (jnp.ones(2).sum() = {info['sum']}), "
                f"numpy {info['numpy']} from the venv")
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if item.path.suffix != ".ipynb":
        return (yield)
    base = _base()
    folder = base / item.path.stem
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    without = _without(item.path.stem)
    saved = {k: os.environ.get(k) for k in ("JAX_LANE_DIR", "PYTHONPATH", *JAX_ENV)}
    os.environ["JAX_LANE_DIR"] = str(folder)  # the kernel nbmake starts inherits it
    for key, value in _START_ENV.items():  # not what jax, run by a test here, left behind
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if without:
        os.environ["PYTHONPATH"] = _path_without_jax()
    try:
        result = yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    why = (without_jax if without else verdict)(proofs(folder))
    if why:
        pytest.fail(f"{item.path.name}: the jax lane did not run with jax: {why}", pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter) -> None:
    base = Path(os.environ.get("JAX_LANE_DIR", ""))
    if not base.is_dir():
        return
    terminalreporter.section("jax lane: processes per notebook, and which took the jax path")
    for folder in sorted(p for p in base.iterdir() if p.is_dir()):
        records = proofs(folder)
        found = sum(bool(r.get("jax_origin")) for r in records)
        took = {m: sum(m in r.get("imported", []) for r in records)
                for m in ("jax", "torchax", "flax")}
        backends = sorted({r["privateuse1"] for r in records if r.get("privateuse1")})
        failed = sorted({f"{m} ({why[:60]})" for r in records
                         for m, why in r.get("failed", {}).items()})
        if _without(folder.name):
            terminalreporter.write_line(f"{folder.name}: {len(records)} process(es), run without "
                                        f"jax (JAX_LANE_WITHOUT), jax on the path in {found}")
            continue
        terminalreporter.write_line(
            f"{folder.name}: {len(records)} process(es), jax on the path in {found}; imported "
            f"jax in {took['jax']}, torchax in {took['torchax']}, flax in {took['flax']}; "
            f"privateuse1 backend: {', '.join(backends) or 'unchanged'}"
            + (f"; failed imports: {'; '.join(failed)}" if failed else ""))
