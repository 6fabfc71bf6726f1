# expect:
# Written here, not copied: pretrained models loaded by one process, which must stay clean (one
# copy on the host, however large): a single-process script that generates on the CPU and one that
# fine-tunes on one XLA device (no launcher, no ordinal read), loading a state dict with torch.load
# too.
# ruff: noqa
import torch
import torch_xla
from transformers import AutoModelForCausalLM, AutoTokenizer


def generate(name, prompt):
    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return tokenizer.decode(model.generate(ids, max_new_tokens=20)[0])


def finetune(name, weights, batches):
    device = torch_xla.device()
    model = AutoModelForCausalLM.from_pretrained(name).to(device)
    model.load_state_dict(torch.load(weights, weights_only=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for batch in batches:
        model(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
