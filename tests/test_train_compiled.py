"""Ours' step lazily, under ``torch_xla.compile`` and with the model under ``torch.compile(
backend="openxla")``: which trains to the same losses (the claims of the README's benchmark
section and of benchmarks/bench_training.py rows f and g), and the foreach optimizers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm

from course.datasets import load_digits
from course.models import DigitsCNN
from tpu_helpers.train import Config, builtin_optimizer, step_seed, train_step

STEPS = 12
_RUNS: dict[tuple[str, float], torch.Tensor] = {}  # one run per (how, dropout) in this process


def _losses(how: str, dropout: float = 0.25) -> torch.Tensor:
    if (how, dropout) not in _RUNS:
        _RUNS[how, dropout] = _train(how, dropout)
    return _RUNS[how, dropout]


def _train(how: str, dropout: float) -> torch.Tensor:
    device = torch_xla.device()
    images, labels = load_digits("train")
    # each step's batch is uploaded as fit's loader does: one graph for every step (indexing a
    # device tensor with the step number would make each step a program of its own)
    x = torch.from_numpy(images[:STEPS * 32]).view(STEPS, 32, 1, 8, 8)
    y = torch.from_numpy(labels[:STEPS * 32]).view(STEPS, 32)
    torch.manual_seed(0)
    model = DigitsCNN(dropout=dropout).to(device)
    optimizer = builtin_optimizer(model.parameters(), Config(optimizer="sgd", lr=0.05))
    net = torch.compile(model, backend="openxla") if how == "dynamo" else model

    def step(totals, k, xb, yb):  # as fit's loop: the seed, then the step; totals on the device
        xm.set_rng_state(step_seed(0, k))
        return totals + train_step(net, optimizer, xb, yb)

    compiled = torch_xla.compile(step) if how == "xla" else None
    losses = []
    for k in range(STEPS):
        totals = torch.zeros(3, device=device)
        xb, yb = x[k].to(device), y[k].to(device)
        if compiled is not None:
            totals = compiled(totals, k, xb, yb)
        else:
            totals = step(totals, k, xb, yb)
            torch_xla.sync()
        losses.append(totals[0] / totals[2])
    return torch.stack(losses).cpu()


@pytest.mark.slow
def test_torch_xla_compile_trains_the_same_losses_bit_for_bit():
    lazy = _losses("lazy")
    assert torch.equal(_losses("xla"), lazy)
    assert lazy[-4:].mean() < lazy[:4].mean()  # it trains


@pytest.mark.slow
def test_dynamo_openxla_matches_without_dropout_and_draws_other_masks_with_it():
    assert torch.equal(_losses("dynamo", dropout=0.0), _losses("lazy", dropout=0.0))
    assert not torch.equal(_losses("dynamo"), _losses("lazy"))  # its own dropout masks


def test_foreach_optimizers_step_like_the_for_loop():
    device = torch_xla.device()
    x, y = torch.randn(16, 1, 8, 8).to(device), torch.randint(0, 10, (16,)).to(device)
    for name in ("sgd", "adamw"):
        weights = []
        for foreach in (False, True):
            torch.manual_seed(0)
            model = DigitsCNN(dropout=0.0).to(device)
            opt = builtin_optimizer(model.parameters(), Config(optimizer=name))
            for group in opt.param_groups:
                group["foreach"] = foreach
            for _ in range(3):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                torch_xla.sync()
            weights.append([p.cpu() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True)), name
