# expect: pretrained-per-replica@30 pretrained-per-replica@34 pretrained-per-replica@43 pretrained-per-replica@56
# Written here, not copied: the loading that dies first on a TPU host, as issue 1262 quotes it
# (GPT-2 `from_pretrained` then `model.to(device).train()` in every xmp.spawn process: "GPT2-large
# can fill up to 80GB of ram when loaded by all processes") and issue 1870 shows it (XLM-R moved
# with `.to(xm.xla_device())` in the xmp context: "8 copies of the model"): chained, moved later,
# a state dict from torch.load, a helper the launched function calls. Precision traps that must
# stay clean: the tokenizer and the config (never moved), a model loaded only where
# xr.local_ordinal() == 0 (once per host), `.to(torch.bfloat16)` (a dtype), torch.load with
# mmap=True, a resume checkpoint read as a dict, the model built on the device and streamed
# (tpu_helpers.pretrained.stream_to_device), an export after the launch (one process).
# ruff: noqa
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

from tpu_helpers.pretrained import stream_to_device

MODEL = "gpt2-large"


def _mp_fn(index, flags):
    device = torch_xla.device()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    config = AutoConfig.from_pretrained(MODEL)
    if not xm.is_master_ordinal():
        xm.rendezvous("download_only_once")
    model = GPT2LMHeadModel.from_pretrained(MODEL)
    if xm.is_master_ordinal():
        xm.rendezvous("download_only_once")
    model.to(device).train()
    head = AutoModelForCausalLM.from_pretrained(flags.head).to(device)
    half = AutoModelForCausalLM.from_pretrained(flags.head).to(torch.bfloat16)
    if xr.local_ordinal() == 0:
        teacher = AutoModelForCausalLM.from_pretrained(flags.teacher).to(device)
    restore(model, flags, device)
    finetune(model, head, tokenizer, device)


def restore(model, flags, device):
    state = torch.load(flags.weights, map_location="cpu")
    model.load_state_dict(state)
    mapped = torch.load(flags.weights, map_location="cpu", mmap=True)
    model.load_state_dict(mapped, assign=True)
    resume = torch.load(flags.resume, weights_only=True)
    step = resume["step"]
    with torch.device(device):
        student = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(flags.student))
    stream_to_device(student, flags.student)
    return step


def finetune(model, head, tokenizer, device):
    model.load_state_dict(torch.load("pytorch_model.bin"), strict=False)


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=(None,))
    merged = GPT2LMHeadModel.from_pretrained("out").to(torch_xla.device())
    merged.save_pretrained("merged")
