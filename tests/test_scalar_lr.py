"""``scalar_lr``: the learning-rate multiplier of LDM-RLS's forgetting factors λ and importance weights ω.

It is a gain on their parameters, so under Adam (whose step does not depend on a gradient's scale) one step moves
λ's and ω's logits ``scalar_lr`` times as far as without it, while the model at initialization is unchanged.
"""

from __future__ import annotations

import pytest
import torch

import variants
from harness.config import build_config
from harness.errors import UsageError
from harness.model.diagnostics import traced_forward
from harness.model.factory import build_model


def _model(spec: str):
    cfg = build_config({"model": {"preset": "tiny", "n_blocks": 1}, "variant": spec})
    torch.manual_seed(0)
    return cfg, build_model(cfg.model, spec).double()


def _logits_after_one_adam_step(spec: str, idx):
    cfg, model = _model(spec)
    mixer = model.mixer
    gain = mixer.cfg.scalar_lr
    before_lambda = (mixer.theta.detach() * gain).clone()
    G, dk = mixer.G, mixer.dk
    before_omega = [m.fc2.bias.detach()[G * dk :].clone() * gain for m in mixer.keys]
    # No ε: Adam's step is then exactly independent of a gradient's scale (λ's gradients are small enough that the
    # default ε of 1e-8 is not negligible beside them, one reason λ learns slowly without a multiplier).
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-30)
    model(idx).square().mean().backward()
    opt.step()
    lam = (mixer.theta.detach() * gain - before_lambda).abs().mean()
    omega = torch.stack(
        [(m.fc2.bias.detach()[G * dk :] * gain - b).abs().mean() for m, b in zip(mixer.keys, before_omega)]
    ).mean()
    return model, lam, omega


def test_a_gain_moves_lambda_and_omega_that_many_times_as_far(rng_seed):
    idx = torch.randint(512, (2, 12))
    plain, lam1, omega1 = _logits_after_one_adam_step("ldm-rls(scalar_lr=1)", idx)
    fast, lam10, omega10 = _logits_after_one_adam_step("ldm-rls(scalar_lr=10)", idx)
    assert float(lam10 / lam1) == pytest.approx(10.0, rel=1e-3)
    assert float(omega10 / omega1) == pytest.approx(10.0, rel=1e-3)


def test_the_model_at_initialization_does_not_depend_on_the_gain(rng_seed):
    idx = torch.randint(512, (2, 12))
    _, plain = _model("ldm-rls(scalar_lr=1)")
    _, fast = _model("ldm-rls(scalar_lr=100)")
    # θ is stored over the gain, so λ is the same to the rounding of that division.
    torch.testing.assert_close(plain(idx), fast(idx), rtol=1e-9, atol=1e-9)


def test_lambda_gradient_norm_is_reported_after_a_step(rng_seed):
    idx = torch.randint(512, (2, 12))
    _, model = _model("ldm-rls")
    _, trace = traced_forward(model, idx)
    assert "lambda_grad_norm" not in model.mixer.learned_statistics(trace)
    model(idx).square().mean().backward()
    stats = model.mixer.learned_statistics(trace)
    assert stats["lambda_grad_norm"] == pytest.approx(float(model.mixer.theta.grad.norm()))


@pytest.mark.parametrize(
    "spec, words",
    [("ldm-rls(scalar_lr=0)", "scalar_lr must be a number > 0"), ("ldm(scalar_lr=2)", "applies only to write=rls")],
)
def test_bad_gains_are_refused_in_one_sentence(spec, words):
    with pytest.raises(UsageError, match=words):
        variants.validate(spec)
