"""Every registered variant can learn: a tiny model memorizes a fixed random batch with plain AdamW.

No Lightning here on purpose: this isolates the mixer's forward and backward from the training harness. The
bar is modest (the loss falls below a tenth of its starting value within 60 steps, where every variant reaches
about a hundredth), so a variant fails only when gradients do not flow or the mixing breaks the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import variants
from harness import build_model, model_preset

# Sixty optimiser steps for every registered variant.
pytestmark = pytest.mark.slow

STEPS = 60


@pytest.fixture(autouse=True)
def one_thread():
    """Models this small only lose time to thread synchronization, badly so on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("spec", variants.names())
def test_variant_memorizes_a_fixed_batch(spec, rng_seed):
    model = build_model(model_preset("tiny", n_blocks=2), spec)
    data = torch.randint(0, model.cfg.vocab_size, (4, 17))
    inputs, targets = data[:, :-1], data[:, 1:]  # (4, 16) each
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[-5:]) < losses[0] / 10, f"{spec}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
