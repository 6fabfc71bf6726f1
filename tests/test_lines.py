"""The rule that picks the tests `make test` runs on the torch_xla 2.8 line too (``tests/lines.py``,
applied by ``tests/conftest.py`` at collection), checked on the real test files and toolkit."""

from __future__ import annotations

import lines
import pytest
from conftest import REPO

pytestmark = pytest.mark.one_line  # reads source text; runs no torch_xla

TESTS = REPO / "tests"


def picked(name: str) -> set[str]:
    return set(lines.both_lines(TESTS / name))


def test_the_version_branches_are_found_in_the_code():
    branching = lines.version_branching_modules()
    # known today: the matched sets, the companion pins, the cache's release check
    assert {"tpu_helpers.env", "course.setup", "course.compile_cache"} <= set(branching)
    assert {"SUPPORTED", "matched_set", "check_versions"} <= branching["tpu_helpers.env"]
    assert "configure_emulation" not in branching["tpu_helpers.env"]
    assert lines.mentions("from tpu_helpers import data, env\nenv.matched_set()",
                          "tpu_helpers.env", {"matched_set"})
    assert not lines.mentions("from tpu_helpers.env import configure_emulation\n",
                              "tpu_helpers.env", {"matched_set"})


def test_a_tests_code_includes_the_scripts_helpers_and_imports_it_uses():
    source = '''
import json
from tpu_helpers.checkpoint import save
SCRIPT = """import lightning as L"""
OTHER = """import jax"""
def helper():
    return SCRIPT
@pytest.fixture
def made():
    return OTHER
def test_a():
    helper()
def test_b(made):
    save(json)
def test_c():
    pass
'''
    code = lines.code_of_tests(source)
    assert "import lightning" in code["test_a"] and "jax" not in code["test_a"]
    assert "import jax" in code["test_b"] and "from tpu_helpers.checkpoint" in code["test_b"]
    assert "import json" in code["test_b"] and "import json" not in code["test_c"]
    assert lines.reasons(code["test_a"]) and lines.reasons(code["test_b"])
    assert not lines.reasons(code["test_c"])


def test_the_rule_picks_the_version_dependent_tests_and_leaves_our_own_logic():
    # integrations, the doctor, the release branches, torch_xla's private API
    assert picked("test_lightning_writer.py")
    assert "test_dynamic_corpus" in picked("test_doctor.py")
    assert "test_install_command_is_a_cpu_build" in picked("test_env.py")
    assert picked("test_compile_cache.py") and picked("test_hf_accelerate.py")
    assert picked("test_spmd_multihost.py")  # distributed checkpoints
    # our own logic through the calls the notebooks make: one line
    for name in ("test_checkpoint.py", "test_buckets.py", "test_train_resume.py",
                 "test_predict.py", "test_data.py", "test_train_hooks.py"):
        assert not picked(name), name
    # and per test, not per file: the profiler test of the claims, not the counting ones
    claims = picked("test_performance_claims.py")
    assert claims and "test_every_fix_compiles_nothing_after_warm_up" not in claims


def test_every_pattern_is_explained_and_matches_its_example():
    examples = ["import lightning as L", "from transformers import Trainer", "import jax",
                "torch_xla.amp.GradScaler", "xm.mesh_reduce('x', 1, sum)",
                "import torch.distributed.checkpoint as dist_cp", "xp.Trace('f')",
                "torch_xla.compile(step)", "torch_xla._XLAC._xla_sync", "tpu_helpers.doctor"]
    assert len(examples) == len(lines.LINE_SENSITIVE)
    for example, why in zip(examples, lines.LINE_SENSITIVE.values(), strict=True):
        assert lines.reasons(example) == [why], example
    assert not lines.reasons("import torch_xla\nx = torch_xla.device()\ntorch_xla.sync()")
