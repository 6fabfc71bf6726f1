"""course.text's TinyGPT hooks (notebook 10) and the checkpointing claim notebook 10 makes:
PyTorch's own ``torch.utils.checkpoint`` fails on the XLA device, torch_xla's works and
gives the same gradients. Real torch_xla on XLA:CPU, one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
import torch_xla
from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

from course.text import TinyGPT, causal_attention


def _model(cls=TinyGPT, **kwargs):
    torch.manual_seed(0)
    return cls(16, 2, 2, max_len=8, **kwargs)


def _grads(model, device):
    model = model.to(device)
    tokens = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:]).backward()
    torch_xla.sync()
    return torch.cat([p.grad.cpu().flatten() for p in model.parameters()])


def test_attend_and_layers_hooks_keep_the_default_model():
    tokens = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    calls = []

    def counting(q, k, v):
        calls.append(q.shape)
        return causal_attention(q, k, v)

    class Doubled(TinyGPT):
        def layers(self, x):
            return self.blocks(self.blocks(x))

    with torch.no_grad():
        plain, hooked = _model()(tokens), _model(attend=counting)(tokens)
        doubled = _model(Doubled)(tokens)
    assert torch.equal(plain, hooked) and len(calls) == 2
    assert not torch.allclose(plain, doubled)


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_fails_on_xla(reentrant):
    class TorchCheckpointed(TinyGPT):
        def layers(self, x):
            for block in self.blocks:
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            return x

    with pytest.raises(AttributeError, match="has no attribute 'xla'"):
        _grads(_model(TorchCheckpointed), torch_xla.device())


def test_torch_xla_checkpoint_gives_the_same_gradients():
    class Checkpointed(TinyGPT):
        def layers(self, x):
            for block in self.blocks:
                x = xla_checkpoint(block, x)
            return x

    device = torch_xla.device()
    plain, remat = _grads(_model(), device), _grads(_model(Checkpointed), device)
    assert (plain - remat).abs().max() < 1e-5
