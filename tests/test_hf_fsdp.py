"""Notebook 12, section 3: FSDPv2 with the Trainer (transformers 5.24.0) on 4 virtual devices under
SPMD, with a real Trainer and real torch_xla; the SPMD runs share one fresh process of their own
(SPMD is process-wide). The notebook's own script is run as written, taken from its cells."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import run_script  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "12_accelerate_and_fsdp_v2.ipynb"


def notebook_script() -> str:
    """The script the notebook writes with %%writefile (and %%writefile -a), in order."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    parts = ["".join(c["source"]).partition("\n") for c in cells if c["cell_type"] == "code"]
    return "\n".join(body for head, _, body in parts if head.startswith("%%writefile")
                     and head.endswith("/fsdp_v2.py")) + "\n"


# Appended to the notebook's script: what its output does not show.
PROBES = """
gpt2 = trainer.model.module
batch = next(iter(trainer.get_train_dataloader()))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    trainer.model(**batch)
probe = dict(input_sharding=torch_xla._XLAC._get_xla_sharding_spec(batch["input_ids"]),
             rows=batch["input_ids"].shape[0],
             hook_warning=any("backward hooks" in str(w.message) for w in seen),
             output=type(trainer.model(**batch)).__name__,
             tied=gpt2.lm_head.weight is gpt2.transformer.wte.weight,
             params=len(list(trainer.model.parameters())))
with open(f"{OUT}/probe.json", "w") as f:
    json.dump(probe, f)
"""


#: Appended after the probes, in the same SPMD process on 4 devices (asserted): the Trainer with
#: fsdp_config FSDPv2 once the optimizer it skips is created. Any other error is printed on one
#: line (not a traceback), so that it fails only its own test.
FSDP_PAST_THE_OPTIMIZER = """
assert xr.is_spmd() and xr.global_runtime_device_count() == 4
past_tok = byte_tokenizer()
past_data = [{**past_tok(t, padding="max_length", max_length=32),
              "labels": past_tok(t, padding="max_length", max_length=32)["input_ids"]}
             for t in speeches(32)[:8]]
past_args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=4, max_steps=1,
    optim="adamw_torch_xla", report_to="none", save_strategy="no", disable_tqdm=True,
    dataloader_pin_memory=False, fsdp="full_shard", fsdp_config={"xla": True, "xla_fsdp_v2": True})


class CreatesTheOptimizer(Trainer):  # what transformers 5.24.0 skips for FSDP on XLA
    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.optimizer is None:
            self.create_optimizer()
            self.optimizer = self.accelerator.prepare(self.optimizer)
        return super().create_scheduler(num_training_steps, optimizer)


try:
    CreatesTheOptimizer(model=tiny_gpt2(past_tok, 32), args=past_args,
                        train_dataset=past_data).train()
    print("TRAINED")
except ValueError as err:
    print("FAILED", err)
except Exception as err:  # noqa: BLE001 - reported on one line, read by its own test
    print("PAST THE OPTIMIZER RAISED", repr(err).replace(chr(10), " "))
"""


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    """One SPMD process (4 devices): the notebook's script, the probes, then the Trainer past
    the optimizer (one fresh Python with torch_xla and transformers instead of two)."""
    folder = tmp_path_factory.mktemp("fsdp")
    proc = run_script(folder, "fsdp_v2.py", notebook_script() + PROBES + FSDP_PAST_THE_OPTIMIZER,
                      str(folder), timeout=900)
    return (proc, json.loads((folder / "fsdp_v2.json").read_text()),
            json.loads((folder / "probe.json").read_text()))


def test_fsdp_config_v2_fails_before_the_first_step(script_run):
    """transformers 5.24.0 delays optimizer creation for FSDP on XLA and never creates it
    (trainer.py, _prepare_for_training): the scheduler gets None."""
    proc, out, _ = script_run
    assert out["failure"] == "AttributeError: 'NoneType' object has no attribute 'param_groups'"
    assert "Traceback" not in proc.stdout + proc.stderr  # one line, not a traceback


def test_hand_wrapped_fsdp_v2_holds_a_quarter_per_device_and_the_trainer_trains_it(script_run):
    proc, out, probe = script_run
    n = len(out["before"])
    assert n == 4 and out["world_size"] == 1  # one process drives the 4 devices
    assert all(b == out["total"] for b in out["before"])          # replicated: the whole model
    assert sum(out["after"]) >= out["total"] and max(out["after"]) / out["total"] < 1 / n + 0.01
    assert out["trained"] == out["after"]                        # still sharded after training
    assert len(out["losses"]) == 4 and out["losses"][-1] < out["losses"][0]
    assert "with FSDPv2" in proc.stdout and "Traceback" not in proc.stdout


def test_the_trainers_batches_are_split_by_row_over_fsdp(script_run):
    _, _, probe = script_run
    assert probe["rows"] == 8 and probe["input_sharding"].startswith("{devices=[4,1]")


def test_gpt2_output_skips_fsdp_v2s_backward_hook_and_weights_stay_tied(script_run):
    _, _, probe = script_run
    assert probe["output"] == "CausalLMOutputWithCrossAttentions" and probe["hook_warning"]
    assert probe["tied"] and probe["params"] == 16  # lm_head is wte: one embedding, not two


def test_past_the_optimizer_the_trainers_shard_output_rejects_gpt2s_output(script_run):
    proc, _, _ = script_run
    assert "FAILED Something went wrong, the output of the model shouldn't be `None`" in proc.stdout


def test_the_failures_read_from_the_source():
    from transformers import Trainer
    from transformers.integrations import tpu
    from transformers.modeling_outputs import (
        CausalLMOutputWithCrossAttentions,
        CausalLMOutputWithPast,
    )

    prepare = inspect.getsource(Trainer._prepare_for_training)
    assert "or self.is_fsdp_xla_enabled" in prepare.split("delay_optimizer_creation = ")[1]
    assert "use_accelerator_prepare = model is self.model" in prepare
    shard = inspect.getsource(tpu.wrap_model_xla_fsdp)
    assert "elif isinstance(output, CausalLMOutputWithPast):" in shard
    assert not issubclass(CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast)
    assert "tie_weights()" in inspect.getsource(Trainer._move_model_to_device)


def test_moving_gpt2_to_xla_unties_its_embeddings_and_tie_weights_ties_them():
    import torch_xla

    from course.hf import byte_tokenizer, tiny_gpt2

    model = tiny_gpt2(byte_tokenizer(), 32, layers=1)
    assert model.lm_head.weight is model.transformer.wte.weight
    model.to(torch_xla.device())
    assert model.lm_head.weight is not model.transformer.wte.weight
    model.tie_weights()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.device.type == "xla" and torch.is_tensor(model.lm_head.weight)
