"""Every hand-written backward pass and fused path against plain autograd on the reference formula, in float64.

The fast paths (``variants/ops/__init__.py``, the stream read and write of HC and mHC, the Sinkhorn projection) exist
for speed only; each must compute the same values and gradients as the plain formula it replaces, to float64
rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import build_model, model_preset
from variants.mhc import sinkhorn_knopp, sinkhorn_reference
from variants.ops import dot, normalized_projection, rms_scale, unit
from variants.ops.streams import StreamRead, StreamWrite

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
    _assert_same(rms_scale, lambda x: torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), [a])
    _assert_same(unit, lambda x: F.normalize(x, dim=-1), [a])
    assert torch.autograd.gradcheck(lambda x: rms_scale(x, 0.1), (a[..., :5].clone().requires_grad_(),))


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


@pytest.mark.parametrize("n", [1, 3, 4])
def test_stream_read_and_write_equal_their_einsums(n, rng_seed):
    b, t, d = 2, 5, 6
    pre, X = torch.randn(b, t, n, **F64), torch.randn(b, t, n, d, **F64)
    res, post, v = torch.randn(b, t, n, n, **F64), torch.randn(b, t, n, **F64), torch.randn(b, t, d, **F64)
    _assert_same(StreamRead.apply, lambda p, x: torch.einsum("btk,btkd->btd", p, x), [pre, X])
    _assert_same(
        StreamWrite.apply,
        lambda r, x, p, u: torch.einsum("btjk,btkd->btjd", r, x) + p.unsqueeze(-1) * u.unsqueeze(-2),
        [res, X, post, v],
    )
    # Gradients that arrive broadcast (the head's sum over streams hands back an expanded one).
    got = torch.autograd.grad(StreamWrite.apply(res, X.requires_grad_(), post, v).sum(-2).sum(), X)[0]
    torch.testing.assert_close(got, res.sum(-2).unsqueeze(-1).expand_as(X), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("n, iters", [(2, 1), (4, 20), (3, 7)])
def test_sinkhorn_backward_equals_autograd_through_the_iterations(n, iters, rng_seed):
    logits = 2.0 * torch.randn(3, 5, n, n, **F64)
    _assert_same(
        lambda x: sinkhorn_knopp(x, iters), lambda x: sinkhorn_reference(x, iters), [logits], rtol=1e-10, atol=1e-12
    )
    assert torch.autograd.gradcheck(lambda x: sinkhorn_knopp(x, iters), (logits[:1, :2].clone().requires_grad_(),))


def _model_pair(spec: str):
    """The same float64 model twice: the fast path and the reference path of its mixer."""
    fast = build_model(model_preset("tiny", n_blocks=2), spec).to(torch.float64)
    with torch.no_grad():  # away from the initialization, where several connections are exactly trivial
        for p in fast.mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    reference = build_model(model_preset("tiny", n_blocks=2), spec).to(torch.float64)
    reference.load_state_dict(fast.state_dict())
    reference.mixer.impl = "reference"
    return fast, reference


@pytest.mark.parametrize(
    "spec", ["hc", "hc(dynamic=off)", "hc(expansion=3)", "mhc", "mhc(expansion=2,sinkhorn_iters=3)"]
)
def test_stream_mixers_fast_path_equals_reference_values_and_gradients(spec, rng_seed):
    fast, reference = _model_pair(spec)
    assert fast.mixer.impl == "fused"
    idx, targets = torch.randint(0, 512, (2, 12)), torch.randint(0, 512, (2, 12))
    losses = []
    for model in (fast, reference):
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=0)
    grads = dict(reference.named_parameters())
    for name, p in fast.named_parameters():
        expected = grads[name].grad
        assert expected is not None and expected.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("spec, collected", [("hc", "mixer.proj"), ("mhc", "mixer.phi")])
def test_collected_write_gradients_survive_a_second_backward(spec, collected, rng_seed):
    """HC and mHC: every use of the stream adds its gradient into one buffer; a second backward through the
    retained graph must start from zero again, so two backward passes give exactly twice the gradient of one."""
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", ["attnres", "attnres-block", "attnres-block(block_size=2)", "attnres-block(block_size=3)", "denseformer"]
)
def test_depth_mixers_fast_path_equals_reference_values_and_gradients(spec, rng_seed):
    fast, reference = _model_pair(spec)
    assert fast.mixer.impl == "fused"
    idx, targets = torch.randint(0, 512, (2, 12)), torch.randint(0, 512, (2, 12))
    losses = []
    for model in (fast, reference):
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=0)
    grads = dict(reference.named_parameters())
    for name, p in fast.named_parameters():
        expected = grads[name].grad
        assert expected is not None and expected.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12, msg=name)
    # A second backward through a retained graph recomputes its buffers: exactly twice the gradient of one.
    fast.zero_grad()
    loss = fast(idx).square().mean()
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in fast.named_parameters()}
    loss.backward()
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-12, atol=1e-14, msg=name)


def test_denseformer_outputs_live_in_one_buffer_and_take_their_gradient_once(monkeypatch, rng_seed):
    """The DWAs read the block outputs from one buffer and hand autograd no gradient for them; each output's
    ``Stored`` node returns its whole gradient once, after every DWA that read it. Autograd saves nothing per
    output. Gradients stay the reference's (test above)."""
    from variants import denseformer

    model = build_model(model_preset("tiny", n_blocks=3), "denseformer").to(torch.float64)
    with torch.no_grad():  # away from the identity, where the older outputs' weights are exactly zero
        for p in model.mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    order = []
    for fn, tag in ((denseformer.WeightedAverage, "dwa"), (denseformer.Stored, "out")):
        backward = fn.backward

        def recording(ctx, *grads, backward=backward, tag=tag):
            result = backward(ctx, *grads)
            order.append((tag, ctx.i if tag == "dwa" else ctx.j, result))
            return result

        monkeypatch.setattr(fn, "backward", staticmethod(recording))
    idx = torch.randint(0, 512, (2, 12))
    saved = {}
    for name, m in (("denseformer", model), ("preln", build_model(model_preset("tiny", n_blocks=3), "preln"))):
        shapes = saved[name] = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, shapes=shapes: shapes.append(t.shape) or t, lambda t: t
        ):
            loss = m.to(torch.float64)(idx).square().mean()
    loss = model(idx).square().mean()
    loss.backward()
    dwa = [(i, r) for tag, i, r in order if tag == "dwa"]
    out = [(j, r) for tag, j, r in order if tag == "out"]
    assert [i for i, _ in dwa] == [2, 1, 0] and sorted(j for j, _ in out) == [0, 1, 2, 3]
    assert all(g is None for _, r in dwa for g in r[1:])  # no gradient for any output through autograd
    for j, r in out:
        assert r[0] is not None and r[0].abs().sum() > 0
        # every DWA that read X_j (DWA i reads X_0 .. X_{i+1}) ran its backward before X_j's
        later = [k for k, (tag, i, _) in enumerate(order) if tag == "dwa" and i >= j - 1]
        assert max(later) < order.index(next(o for o in order if o[0] == "out" and o[1] == j))
    # The buffer holds the outputs, not autograd: it saves as many per-token tensors as PreLN's decoder does.
    per_token = {name: sum(1 for shape in shapes if shape[:2] == (2, 12)) for name, shapes in saved.items()}
    assert per_token["denseformer"] == per_token["preln"]


def test_denseformer_output_read_by_a_dwa_without_gradient_gets_only_the_others_share(rng_seed):
    """Where a later DWA's result does not reach the loss, its backward never runs: its row of the buffer still
    holds a block output, which must not count as its gradient."""
    from variants import denseformer

    xs = [torch.randn(2, 5, 4, **F64, requires_grad=True) for _ in range(3)]
    alphas = [torch.randn(2, **F64, requires_grad=True), torch.randn(3, **F64, requires_grad=True)]
    buf = denseformer.OutputBuffer(xs[0], 2)
    handles = [denseformer.Stored.apply(xs[0], buf, 0), denseformer.Stored.apply(xs[1], buf, 1)]
    y0 = denseformer.WeightedAverage.apply(alphas[0], buf, 0, *handles)
    handles.append(denseformer.Stored.apply(xs[2], buf, 2))
    denseformer.WeightedAverage.apply(alphas[1], buf, 1, *handles)  # its result is not used
    weight = torch.randn_like(y0)
    (y0 * weight).sum().backward()
    got = [x.grad.clone() for x in xs[:2]] + [alphas[0].grad.clone()]
    for x in xs + alphas:
        x.grad = None
    ((alphas[0][0] * xs[0] + alphas[0][1] * xs[1]) * weight).sum().backward()
    for g, x in zip(got, xs[:2] + alphas[:1]):
        torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-14)
    assert xs[2].grad is None and alphas[1].grad is None


def test_attnres_source_read_by_a_reader_without_gradient_gets_only_the_others_share(rng_seed):
    """Full AttnRes leaves each reader's ∂a over the values' memory; where a later reader's result does not reach
    the loss, its backward never runs and its row still holds a value (here NaN), which must count as zero."""
    from variants import attnres

    b, t, d = 2, 5, 6
    e, v0, v1 = (torch.randn(b, t, d, **F64, requires_grad=True) for _ in range(3))
    queries = torch.randn(2, d, **F64, requires_grad=True)  # readers 1 and 2 (the head)
    buf = attnres.DepthBuffers(e, queries)
    buf.values.fill_(float("nan"))  # what fresh memory may hold where nothing was stored
    handles = [attnres.FusedWrite.apply(e, queries, buf, 0), attnres.FusedWrite.apply(v0, queries, buf, 1)]
    a1 = attnres.FusedRead.apply(buf, 1, *handles)
    handles.append(attnres.FusedWrite.apply(v1, queries, buf, 2))
    attnres.FusedRead.apply(buf, 2, *handles)  # its result is not used
    weight = torch.randn_like(a1)
    (a1 * weight).sum().backward()
    got = [x.grad.clone() for x in (e, v0, queries)]
    for x in (e, v0, v1, queries):
        x.grad = None
    keys = [attnres.rms_normalize(x) for x in (e, v0)]
    a, _ = attnres.depth_attention(queries[0], keys, [e, v0])
    (a * weight).sum().backward()
    for g, x in zip(got, (e, v0, queries)):
        torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-14)
    assert v1.grad is None
