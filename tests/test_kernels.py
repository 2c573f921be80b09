"""The fused kernels of variants/kernels/ (depth_read, whiten, softmax_read, sinkhorn) against float64 references,
in Triton's interpreter without a GPU.

Each kernel's forward and gradients are held to the plain PyTorch beside it run in float64, at odd sizes that
leave every tile partly masked, and the models that use them give the same logits and gradients with the kernels
on and off. Triton is a test dependency; where it is missing the module is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need Triton (pip install triton)")

from harness.config import build_config  # noqa: E402
from harness.model.factory import build_model  # noqa: E402
from variants import kernels  # noqa: E402
from variants.kernels.buffer import DepthBuffer  # noqa: E402
from variants.kernels.depth_read import depth_read  # noqa: E402
from variants.kernels.depth_read import naive as depth_naive  # noqa: E402
from variants.kernels.sinkhorn import naive as sinkhorn_naive  # noqa: E402
from variants.kernels.sinkhorn import sinkhorn  # noqa: E402
from variants.kernels.softmax_read import buffer_read as softmax_buffer_read  # noqa: E402
from variants.kernels.softmax_read import naive as softmax_naive  # noqa: E402
from variants.kernels.whiten import buffer_whiten  # noqa: E402
from variants.kernels.whiten import naive as whiten_naive  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or kernels.interpreting()), reason="no GPU and TRITON_INTERPRET is not set"
)
# float32: a softmax over logits of tens (Gaussian queries against width-100 values up to five times their scale)
# amplifies rounding by the logits' size, so its bound is looser than the sums' would need; a wrong kernel is off
# by O(1).
# bfloat16: one unit in the last place of the largest entry. The inputs are bfloat16 already, so the float64
# reference sees the very values the kernel does, and only the single rounding of a bfloat16 output or gradient
# remains: half a unit on a card, a whole one in the interpreter, whose cast truncates.
TOL = {torch.float32: 1e-4, torch.float64: 1e-12, torch.bfloat16: torch.finfo(torch.bfloat16).eps}
# Where the state is bfloat16: the stored keys, values or sources alone, the query or the new write float32; or
# every input bfloat16.
STATES = {"bf16 state": torch.float32, "all bf16": torch.bfloat16}


def _float64_grads(fn, inputs, g):
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    out = fn(*inputs64)
    return out, torch.autograd.grad(out, inputs64, g.double())


def _close(got, want, dtype):
    assert got.shape == want.shape
    if not want.numel():
        return
    scale = want.abs().max().clamp_min(1.0)
    assert float((got.double() - want).abs().max() / scale) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,writes,key,value", [(1, 1, 1, 1), (37, 5, 7, 11), (70, 13, 48, 48), (5, 3, 17, 33)])
def test_depth_read_equals_float64(rng_seed, dtype, rows, writes, key, value):
    q = torch.randn(rows, key, dtype=dtype, requires_grad=True)
    keys = torch.randn(rows, writes, key, dtype=dtype, requires_grad=True)
    values = torch.randn(rows, writes, value, dtype=dtype, requires_grad=True)
    with kernels.mode("on"):
        m = depth_read(q, keys, values)
    g = torch.randn_like(m)
    grads = torch.autograd.grad(m, (q, keys, values), g)
    want, want_grads = _float64_grads(depth_naive.depth_read, (q, keys, values), g)
    _close(m, want, dtype)
    for got, ref in zip(grads, want_grads):
        _close(got, ref, dtype)


def softmax_read(values: torch.Tensor, query: torch.Tensor, extra: bool = False) -> torch.Tensor:
    """AttnRes's read of stacked sources ``values`` (R, S, d) as the models make it: each source written into a
    depth buffer, or the last passed beside it where ``extra`` (AttnRes's embedding, block AttnRes's partial sum)."""
    n = values.shape[1] - extra
    buffer = DepthBuffer.allocate(max(n, 1), values[:, 0])
    for s in range(n):
        buffer = buffer.append(values[:, s])
    return softmax_buffer_read(buffer, query, values[:, -1] if extra else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("rows,sources,width", [(1, 1, 1), (13, 6, 20), (9, 25, 64), (17, 2, 100)])
def test_softmax_read_equals_float64(rng_seed, dtype, extra, rows, sources, width):
    # Values of very different scales, so the key norm and the online softmax's rescaling both matter.
    values = torch.randn(rows, sources, width, dtype=dtype) * torch.rand(rows, sources, 1, dtype=dtype) * 5
    values.requires_grad_()
    query = torch.randn(width, dtype=dtype, requires_grad=True)
    with kernels.mode("on"):
        a = softmax_read(values, query, extra)
    g = torch.randn_like(a)
    grads = torch.autograd.grad(a, (values, query), g)
    want, want_grads = _float64_grads(lambda v, w: softmax_naive.softmax_read(v, w, 1e-6), (values, query), g)
    _close(a, want, dtype)
    for got, ref in zip(grads, want_grads):
        _close(got, ref, dtype)


def _whiten_inputs(rows, writes, key, value, dtype, state_dtype):
    """``k``, ``v``, ``ridge`` in ``dtype`` and the earlier writes in ``state_dtype``, all requiring gradients."""
    k = torch.nn.functional.normalize(torch.randn(rows, key, dtype=dtype), dim=-1)
    v = torch.randn(rows, value, dtype=dtype)
    ridge = torch.rand(rows, dtype=dtype) + 0.05
    # Earlier writes of unit scale on odd rows: their projections exceed |k|² + d, so the floor holds there; small
    # ones on even rows, where it does not.
    scale = torch.where(torch.arange(rows) % 2 == 1, 1.5, 0.2).to(dtype)[:, None, None]
    keys = torch.randn(rows, writes, key, dtype=dtype) * scale
    if writes:  # an odd row's first earlier write is 3k: l² = 9 > |k|² + d, so the floor holds there whatever the draw
        keys[1::2, 0] = 3 * k[1::2]
    values = torch.randn(rows, writes, value, dtype=dtype)
    return tuple(t.requires_grad_() for t in (k, v, ridge, keys.to(state_dtype), values.to(state_dtype)))


def whiten(k, v, ridge, keys: torch.Tensor, values: torch.Tensor):
    """LDM-RLS's whitening against stacked earlier writes ``keys`` (R, n, k) and ``values`` (R, n, v) as the models
    make it: each written into a depth buffer first."""
    R, n = keys.shape[:2]
    buffer = DepthBuffer.allocate(n + 1, keys.new_empty(R, keys.shape[-1]), values.new_empty(R, values.shape[-1]))
    for j in range(n):
        buffer = buffer.append(keys[:, j], values[:, j])
    return buffer_whiten(buffer, k, v, ridge)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,writes,key,value", [(1, 0, 1, 1), (37, 5, 7, 11), (40, 9, 4, 48), (6, 2, 17, 3)])
def test_whiten_equals_float64_floor_included(rng_seed, dtype, rows, writes, key, value):
    inputs = _whiten_inputs(rows, writes, key, value, dtype, dtype)
    k, v, ridge, keys, values = inputs
    with kernels.mode("on"):
        kt, vt, margin = whiten(*inputs)
    gk, gv = torch.randn_like(kt), torch.randn_like(vt)
    # Without earlier writes their (empty) gradients are never formed: zeros of their shape.
    grads = torch.autograd.grad((kt, vt), inputs, (gk, gv), materialize_grads=True)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    kt64, vt64, margin64 = whiten_naive.whiten(*inputs64)
    grads64 = torch.autograd.grad((kt64, vt64), inputs64, (gk.double(), gv.double()))
    if writes and rows > 1:  # both sides of the floor are exercised
        # |k|² + d from the keys as drawn: a float32 unit vector's squared norm misses 1 by ~1e-7, far beyond the
        # tolerance that tells a floored margin d / (|k|² + d) from one just above it.
        total = k.detach().double().square().sum(-1) + ridge.detach().double()
        floored = margin64.detach() <= ridge.detach().double() / total * (1 + 1e-12)
        assert floored[1::2].all() and not floored.all()  # odd rows by construction, not every even one
    for got, want in zip((kt, vt, margin, *grads), (kt64, vt64, margin64, *grads64)):
        _close(got, want.detach(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,n,iters", [(1, 1, 2), (19, 3, 5), (33, 4, 20), (7, 8, 3)])
def test_sinkhorn_equals_float64(rng_seed, dtype, rows, n, iters):
    logits = (torch.randn(rows, n, n, dtype=dtype) * 2).requires_grad_()
    with kernels.mode("on"):
        m = sinkhorn(logits, iters)
    g = torch.randn_like(m)
    (grad,) = torch.autograd.grad(m, logits, g)
    want, (want_grad,) = _float64_grads(lambda x: sinkhorn_naive.sinkhorn(x, iters), (logits,), g)
    _close(m, want, dtype)
    _close(grad, want_grad, dtype)
    # The last normalization is over rows: each sums to 1 (columns approach 1 with the iterations, as the
    # reference's do, which the comparison above holds the kernel to).
    assert torch.allclose(m.double().sum(-1), torch.ones(rows, n, dtype=torch.float64), atol=1e-5)


def test_off_and_cpu_without_interpreter_run_the_reference(monkeypatch):
    q, keys, values = torch.randn(3, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 5)
    with kernels.mode("off"):
        assert not kernels.active(q)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.active(q)  # auto and on alike: CPU tensors need the interpreter
    with kernels.mode("on"):
        assert not kernels.active(q)
        assert torch.equal(depth_read(q, keys, values), depth_naive.depth_read(q, keys, values))
    with pytest.raises(ValueError, match="auto, on, off"):
        kernels.set_mode("fast")


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        "ldm",
        "ldm(read=memory)",
        "ldm-rls",
        "ldm-rls(lambda=0.7,omega=off,alpha=2.0)",
        "ldm-rls(qk_source=read,residual_write=off)",
        "attnres",
        "attnres-block(block_size=2)",
        "mhc(sinkhorn_iters=5)",
    ],
)
def test_models_agree_with_kernels_on_and_off(rng_seed, variant):
    cfg = build_config({"model": {"preset": "tiny", "n_blocks": 2}, "variant": variant})
    model = build_model(cfg.model, variant).double()
    with torch.no_grad():
        for p in model.mixer.parameters():  # off their initial values, so every query and weight matters
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(cfg.model.vocab_size, (2, 9))
    results = {}
    for mode in ("off", "on"):
        model.zero_grad()
        with kernels.mode(mode):
            logits = model(idx)
        logits.square().mean().backward()
        results[mode] = (logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    (off, off_grads), (on, on_grads) = results["off"], results["on"]
    assert float((on - off).abs().max()) < 1e-12
    assert len(on_grads) == len(off_grads)
    for a, b in zip(on_grads, off_grads):
        assert float((a - b).abs().max()) < 1e-12


def _check_bf16(fn, naive, inputs, out_dtype):
    """``fn`` (a kernel) on ``inputs`` against ``naive`` in float64 on the same values: its output in
    ``out_dtype``, each gradient in its input's dtype, each within ``TOL`` of its dtype."""
    with kernels.mode("on"):
        out = fn(*inputs)
    assert out.dtype == out_dtype
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, g)
    want, want_grads = _float64_grads(naive, inputs, g)
    _close(out, want, out.dtype)
    for t, got, ref in zip(inputs, grads, want_grads):
        assert got.dtype == t.dtype
        _close(got, ref, got.dtype)


@pytest.mark.parametrize("state", STATES)
def test_depth_read_of_bf16_state_equals_float64(rng_seed, state):
    dtype = STATES[state]
    q = torch.randn(37, 48, dtype=dtype, requires_grad=True)
    keys = torch.randn(37, 13, 48, dtype=torch.bfloat16, requires_grad=True)
    values = torch.randn(37, 13, 40, dtype=torch.bfloat16, requires_grad=True)
    _check_bf16(depth_read, depth_naive.depth_read, (q, keys, values), dtype)


@pytest.mark.parametrize("state", STATES)
def test_softmax_read_of_bf16_sources_equals_float64(rng_seed, state):
    dtype = STATES[state]
    values = (torch.randn(13, 25, 100) * torch.rand(13, 25, 1) * 5).bfloat16().requires_grad_()
    query = torch.randn(100, dtype=dtype, requires_grad=True)
    # The read comes out in float32, the precision it is computed in, whatever the sources are stored in.
    _check_bf16(softmax_read, lambda v, w: softmax_naive.softmax_read(v, w, 1e-6), (values, query), torch.float32)


@pytest.mark.parametrize("state", STATES)
def test_whiten_against_bf16_writes_equals_float64(rng_seed, state):
    dtype = STATES[state]
    inputs = _whiten_inputs(37, 5, 48, 40, dtype, torch.bfloat16)
    with kernels.mode("on"):
        kt, vt, margin = whiten(*inputs)
    # Computed in float32, and so come out, whatever the writes are stored in.
    assert kt.dtype == vt.dtype == margin.dtype == torch.float32
    gk, gv = torch.randn_like(kt), torch.randn_like(vt)
    grads = torch.autograd.grad((kt, vt), inputs, (gk, gv))
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    kt64, vt64, margin64 = whiten_naive.whiten(*inputs64)
    grads64 = torch.autograd.grad((kt64, vt64), inputs64, (gk.double(), gv.double()))
    for got, want in zip((kt, vt, margin, *grads), (kt64, vt64, margin64, *grads64)):
        _close(got, want.detach(), got.dtype)
    assert [t.dtype for t in grads] == [t.dtype for t in inputs]


def test_sinkhorn_of_bf16_logits_equals_float64(rng_seed):
    logits = (torch.randn(33, 4, 4) * 2).bfloat16().requires_grad_()
    _check_bf16(lambda x: sinkhorn(x, 20), lambda x: sinkhorn_naive.sinkhorn(x, 20), (logits,), torch.bfloat16)
