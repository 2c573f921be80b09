"""Every hand-written backward pass and fused path against plain autograd on the reference formula, in float64.

The fast paths (LDM's shared query/key MLP pass and the in-place gradient collection of its depth reads) exist for
speed only; each must compute the same values and gradients as the plain formula it replaces, to float64 rounding.
The shared helpers of ``variants/ops/__init__.py`` are plain PyTorch; they are held to their formulas here too.
"""

from __future__ import annotations

import pytest
import torch

from harness import build_model, model_preset
from variants import ldm as ldm_module
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


def test_shared_input_mlps_equal_the_mlps_one_by_one(rng_seed):
    mixer = build_model(model_preset("tiny", n_blocks=2), "ldm").to(torch.float64).mixer
    mlps = [mixer.queries[1], mixer.keys[1], mixer.keys[2]]
    with torch.no_grad():
        for mlp in mlps:
            mlp.norm.weight.uniform_(0.5, 1.5)  # gains away from 1, so folding them in is tested
    x = torch.randn(2, 5, 64, **F64)
    for got, mlp in zip(ldm_module.shared_input_mlps(x, mlps), mlps):
        torch.testing.assert_close(got, mlp(x), rtol=1e-12, atol=1e-13)
    # Under autograd the pass is recomputed in backward: gradients for the input and every weight and gain.
    params = [p for mlp in mlps for p in mlp.parameters()]
    weights = [torch.randn(2, 5, mlp.fc2.out_features, **F64) for mlp in mlps]

    def grads(outs):
        return torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), [xg, *params])

    xg = x.clone().requires_grad_(True)
    got = grads(ldm_module.shared_input_mlps(xg, mlps))
    want = grads([mlp(xg) for mlp in mlps])
    for g, w in zip(got, want):
        assert w.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)


def test_depth_read_saves_only_the_query_and_the_writes(rng_seed):
    """The scores ``k_iᵀ q`` are recomputed in backward: saving them would keep O(L²) tensors over the depth."""
    n = 5
    q, *writes = [torch.randn(3, 4, 2, 8, **F64, requires_grad=True) for _ in range(1 + 2 * n)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        m = ldm_module.DepthRead.apply(q, (None,) * n, *writes)
    assert len(saved) == 1 + 2 * n
    want = sum(v * (k * q).sum(-1, keepdim=True) for k, v in zip(writes[:n], writes[n:]))
    weight = torch.randn_like(m)
    got_grads = torch.autograd.grad((m * weight).sum(), [q, *writes])
    want_grads = torch.autograd.grad((want * weight).sum(), [q, *writes])
    torch.testing.assert_close(m, want, rtol=1e-12, atol=1e-13)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, collected",
    [("ldm", "mixer.keys"), ("ldm-rls(groups=4)", "mixer.keys")],
)
def test_collected_write_gradients_survive_a_second_backward(spec, collected, rng_seed):
    """The reads add a write's gradient into a buffer; a second backward through the retained graph must start from
    zero again, so two backward passes give exactly twice the gradient of one."""
    model = build_model(model_preset("tiny", n_blocks=2), spec).to(torch.float64)
    idx = torch.randint(0, 512, (2, 9))
    loss = model(idx).square().mean()
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loss.backward()
    for name, p in model.named_parameters():
        if name in once:
            torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-12, atol=1e-14, msg=name)
    assert any(n.startswith(collected) for n in once)


def _whiten_formula(k, v, ridge, *writes):
    """The Gram–Schmidt step of the RLS dual form, as plain tensor algebra for autograd."""
    n = len(writes) // 2
    coeffs = [(kj * k).sum(-1, keepdim=True) for kj in writes[:n]]
    k_rest = k - sum(c * kj for c, kj in zip(coeffs, writes[:n]))
    v_rest = v - sum(c * vj for c, vj in zip(coeffs, writes[n:]))
    delta = ((k * k).sum(-1, keepdim=True) + ridge.unsqueeze(-1) - sum(c * c for c in coeffs)).sqrt()
    return torch.cat([k_rest / delta, v_rest / delta], -1)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_whiten_backward_equals_autograd_on_its_formula(n, rng_seed):
    from variants.ops import rls

    b, g, dk, dv = 3, 2, 4, 5
    k, v = torch.randn(b, g, dk, **F64), torch.randn(b, g, dv, **F64)
    ridge = torch.empty(b, g, **F64).uniform_(0.2, 1.0)
    keys = [0.05 * torch.randn(b, g, dk, **F64) for _ in range(n)]  # small enough that δ² stays above the floor
    values = [torch.randn(b, g, dv, **F64) for _ in range(n)]

    def fast(k, v, ridge, *writes):
        kt, vt, _ = rls.whiten(k, v, ridge, tuple(writes[:n]), tuple(writes[n:]))
        return torch.cat([kt, vt], -1)

    _assert_same(fast, _whiten_formula, [k, v, ridge, *keys, *values])
