# expect:
# Precision traps for the Hugging Face rules, modelled on notebook 12's section 2 (a Trainer on
# every chip, its prediction set padded to a multiple of the global batch with the toolkit's
# pad_eval_rows, so dataloader_drop_last=True loses nothing) and on accelerate's
# examples/finetune_lm_tpu.py @ 16cb6eb8 with FSDP v1 settings (no xla_fsdp_v2), eager attention
# and an optimizer chosen.
# ruff: noqa
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from tpu_helpers.data import pad_eval_rows


def main(model_id, rows, world_size):
    model = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation="eager")
    args = TrainingArguments(output_dir="out", optim="adamw_torch", dataloader_drop_last=True,
                             per_device_eval_batch_size=8, fsdp="full_shard",
                             fsdp_config={"xla": True}, report_to="none")
    padded = pad_eval_rows(rows, per_replica_batch=8, world_size=world_size)
    return Trainer(model=model, args=args).predict(padded)
