"""The shared helpers of ``variants/ops/__init__.py`` (dot products, RMS scales, unit vectors, the normalised
projection) against their formulas in float64, and finite at a zero vector.
"""

from __future__ import annotations

import pytest
import torch

from variants.ops import dot, normalized_projection, rms_scale, unit

F64 = dict(dtype=torch.float64)


def _grads(fn, inputs, weight):
    """Values of ``fn(*inputs)`` and the gradients of ``(fn(*inputs) * weight).sum()`` for every input."""
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    return out.detach(), torch.autograd.grad((out * weight).sum(), inputs)


def _assert_same(fast, reference, inputs, *, rtol=1e-12, atol=1e-13):
    out = reference(*inputs)
    weight = torch.randn_like(out)
    got, got_grads = _grads(fast, inputs, weight)
    want, want_grads = _grads(reference, inputs, weight)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert w.abs().sum() > 0, f"input {i} has no gradient to compare"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=f"gradient of input {i}")


@pytest.mark.parametrize("shape", [(3, 5, 16), (2, 4, 7, 16), (1, 257)])
def test_dot_rms_scale_and_unit_equal_their_formulas(shape, rng_seed):
    a, b = torch.randn(*shape, **F64), torch.randn(*shape, **F64)
    _assert_same(dot, lambda x, y: (x * y).sum(-1, keepdim=True), [a, b])
    _assert_same(rms_scale, lambda x: 1.0 / (x * x).mean(-1, keepdim=True).add(1e-6).sqrt(), [a])
    _assert_same(unit, lambda x: x / (x * x).sum(-1, keepdim=True).sqrt(), [a])
    assert torch.autograd.gradcheck(lambda x: rms_scale(x, 0.1), (a[..., :5].clone().requires_grad_(),))


def test_unit_and_norms_stay_finite_at_a_zero_vector(rng_seed):
    """The norms are clamped (``unit``) or shifted (``rms_scale``), so a zero vector, as a write of zeros would
    give, has finite values and gradients: zero for ``unit``, ``1/sqrt(eps)`` for ``rms_scale``."""
    x = torch.randn(3, 8, **F64)
    x[1] = 0.0
    x.requires_grad_(True)
    weight = torch.randn(8, 5, **F64)
    outs = [unit(x), rms_scale(x), normalized_projection(x, weight)]
    grads = torch.autograd.grad(sum((o * torch.randn_like(o)).sum() for o in outs), x)[0]
    assert all(torch.isfinite(o).all() for o in outs) and torch.isfinite(grads).all()
    assert torch.equal(outs[0][1], torch.zeros(8, **F64))
    torch.testing.assert_close(outs[1][1], torch.tensor([1e-6**-0.5], **F64), rtol=1e-12, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("shape, m", [((3, 5, 16), 6), ((2, 4, 7, 16), 24), ((1, 257), 1)])
def test_normalized_projection_equals_its_formula(shape, m, rng_seed):
    x, w = torch.randn(*shape, **F64), torch.randn(shape[-1], m, **F64)

    def reference(x, w):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w

    _assert_same(normalized_projection, reference, [x, w])
    # With a large eps the norm's share of the gradient is not a small correction to the product's.
    small = (x[..., :5].clone().requires_grad_(), w[:5].clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda x, w: normalized_projection(x, w, 0.1), small)
