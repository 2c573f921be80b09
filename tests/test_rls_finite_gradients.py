"""LDM-RLS's gradients stay finite where an importance weight ω is driven towards zero, as large learning rates do.

ω = 2·sigmoid(z) enters the dual form through the ridge entry ``d = Π λ / (α ω)``, whose derivative ``−d / ω``
leaves float32's range once ω falls under about 5e-20 (a logit below about −45), while the loss, which hardly
depends on such a write, stays finite. At a learning rate of 2.4e-2 on the tiny preset training reached logits
of −45 within 50 steps. The tests set the key MLPs' ω outputs to logits between −100 (where d itself overflows)
and −46 in every other group, through the model and through the plain path's functions, in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.config import build_config
from harness.model.factory import build_model
from variants.ops import unit
from variants.ops.rls import forgetting_factor, importance_weight, ridge_diagonal, whiten

UNDERFLOWING_LOGITS = (-100.0, -46.0)


def _underflowing_logits(groups: int) -> torch.Tensor:
    """One ω logit per group: every other group's in ``UNDERFLOWING_LOGITS``, the rest near 0."""
    low = torch.empty(groups).uniform_(*UNDERFLOWING_LOGITS)
    return torch.where(torch.arange(groups) % 2 == 1, low, torch.randn(groups))


@pytest.mark.parametrize("preset", ["tiny", pytest.param("small", marks=pytest.mark.slow)])
def test_every_parameter_gets_a_finite_gradient_when_omega_underflows(rng_seed, preset):
    cfg = build_config({"model": {"preset": preset}, "variant": "ldm-rls"})
    model = build_model(cfg.model, cfg.variant)
    mixer = model.mixer
    rows = slice(mixer.G * mixer.dk, None)  # the key MLP's ω outputs follow the keys
    with torch.no_grad():
        for mlp in mixer.keys:
            mlp.fc2.weight[rows] = 0.1 * torch.randn_like(mlp.fc2.weight[rows])  # ω still varies per token
            mlp.fc2.bias[rows] = _underflowing_logits(mixer.G) / mixer.cfg.scalar_lr
    idx = torch.randint(cfg.model.vocab_size, (2, 17))
    loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients at a finite loss {float(loss):.4g}: {bad}"


def test_the_plain_write_has_finite_gradients_when_omega_underflows(rng_seed):
    """``importance_weight`` → ``ridge_diagonal`` → ``whiten`` over six writes and a read, as the plain path
    chains them, with the ridge entries' forgetting learned."""
    batch, groups, width, writes = 32, 8, 8, 6
    logits = torch.stack([_underflowing_logits(groups).expand(batch, groups) for _ in range(writes)])
    logits = (logits + 0.1 * torch.randn_like(logits)).requires_grad_()
    theta = torch.randn(writes, groups, requires_grad=True)
    raw_keys = torch.randn(writes, batch, groups, width, requires_grad=True)
    raw_values = torch.randn(writes, batch, groups, width, requires_grad=True)
    keys, values, decay = (), (), None
    for n in range(writes):
        lam = forgetting_factor(theta[n])
        decay = lam if decay is None else decay * lam
        ridge = ridge_diagonal(decay, importance_weight(logits[n]), alpha=1.0)
        k, v, margin = whiten(unit(raw_keys[n]), raw_values[n], ridge, keys, values)
        assert torch.isfinite(margin)
        keys, values = keys + (k,), values + (v,)
    query = unit(torch.randn(batch, groups, width))
    read = sum(v * (k * query).sum(-1, keepdim=True) for k, v in zip(keys, values))  # M q = Σ ṽ (k̃ᵀ q)
    read.square().sum().backward()
    for name, t in (("ω logits", logits), ("θ", theta), ("keys", raw_keys), ("values", raw_values)):
        assert torch.isfinite(t.grad).all(), name
