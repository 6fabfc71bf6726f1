# expect: hf-sdpa-host-read@22 hf-fsdp-v2@31 hf-default-optim@36 hf-eval-drop-last@36
# Models huggingface/accelerate examples/finetune_lm_tpu.py @ 16cb6eb8 (2025): FSDPv2 settings
# handed to the Trainer's arguments as a ** dict (`xla_fsdp_v2`, which fails before the first step
# in transformers 5.24.0: notebook 12, section 3); and a learner's first Trainer on XLA as notebook
# 11 measures it: default TrainingArguments (fused AdamW refuses XLA tensors at step 1), GPT-2 with
# sdpa attention named (a device read every step), dataloader_drop_last=True with an evaluation set
# that is not padded (its last partial batch is never scored). Precision traps: arguments from a
# ** dict the doctor cannot see (no default-optim finding), eager attention, an optim given.
# ruff: noqa
import argparse

import torch
import torch_xla.runtime as xr
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

xr.use_spmd()


def build(model_id, train_rows, eval_rows, settings):
    model = AutoModelForCausalLM.from_pretrained(model_id, torch_dtype=torch.bfloat16)
    plain = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation="eager")
    sdpa = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation="sdpa")
    fsdp_training_args = {
        "fsdp": "full_shard",
        "fsdp_config": {
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "xla": True,
            "xla_fsdp_v2": True,
        },
    }
    sharded = TrainingArguments(output_dir="out", optim="adafactor", save_strategy="no",
                                **fsdp_training_args)
    unseen = TrainingArguments(**settings)  # what it holds is not known here
    good = TrainingArguments(output_dir="out", optim="adamw_torch_xla",
                             per_device_train_batch_size=8, report_to="none")
    first = TrainingArguments(output_dir="out", per_device_train_batch_size=8,
                              dataloader_drop_last=True, report_to="none")
    trainer = Trainer(model=sdpa, args=first, train_dataset=train_rows, eval_dataset=eval_rows)
    trainer.train()
    return trainer.evaluate(), Trainer(model=plain, args=good, train_dataset=train_rows), sharded


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_id", default="meta-llama/Llama-3.2-1B")
    build(parser.parse_args().model_id, [], [], {"output_dir": "out"})
