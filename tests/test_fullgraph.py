"""Every variant compiles as one graph (``torch.compile(fullgraph=True)``) and a training step never waits on the
device: no graph break, no ``.item()``, no Python branch on a tensor's value.

Dynamo and AOT autograd are what refuse a graph break or a data-dependent branch, so the ``aot_eager`` backend
checks both in seconds; inductor's own code generation is covered by tests/test_compile.py, which trains every
variant compiled. A host synchronisation shows in the profiler as ``aten::item`` or ``aten::_local_scalar_dense``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import variants
from harness.config import build_config
from harness.model.factory import build_model
from variants import kernels

# Every test compiles with torch.compile.
pytestmark = pytest.mark.slow

KNOBS = [
    "ldm(read=memory)",
    "ldm(groups=4,key_dim=8)",
    "ldm-rls(lambda=0.7,omega=off,alpha=2.0)",
    "ldm-rls(read=memory)",
    "ldm-rls(qk_source=read,residual_write=off)",
    "attnres-block(block_size=2)",
    "hc(expansion=2)",
    "mhc(sinkhorn_iters=3)",
]
SYNCS = ("aten::item", "aten::_local_scalar_dense")


def _model(variant: str, n_blocks: int = 1, dtype=torch.float64):
    cfg = build_config({"model": {"preset": "tiny", "n_blocks": n_blocks}, "variant": variant})
    model = build_model(cfg.model, variant).to(dtype)
    with torch.no_grad():
        for p in model.mixer.parameters():  # off their initial values, so every mixing weight matters
            p.add_(0.05 * torch.randn_like(p))
    return cfg, model


def _step(model, idx):
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    return logits.detach()


def _syncs(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in SYNCS)


@pytest.mark.parametrize("variant", variants.names() + KNOBS)
def test_compiles_as_one_graph_matches_eager_and_never_waits_on_the_device(rng_seed, variant):
    # One block: two layers and the head's read cover a mixer's every kind of node (its first layer, a layer that
    # reads earlier writes, the head) at a fraction of a deeper model's tracing time.
    cfg, model = _model(variant)
    idx = torch.randint(cfg.model.vocab_size, (2, 10))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _step(compiled, idx)  # compiles
    model.zero_grad()
    got = []
    assert _syncs(lambda: got.append(_step(compiled, idx))) == 0
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want = _step(model, idx)
    assert float((got[0] - want).abs().max()) < 1e-10
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert float((got_grads[name] - p.grad).abs().max()) < 1e-10, name


@pytest.mark.skipif(not (torch.cuda.is_available() or kernels.interpreting()), reason="the kernels need Triton")
@pytest.mark.parametrize("variant", ["ldm", "ldm-rls", "attnres"])
def test_an_eager_step_with_the_kernels_never_waits_on_the_device(variant):
    pytest.importorskip("triton")
    cfg, model = _model(variant, dtype=torch.float32)
    idx = torch.randint(cfg.model.vocab_size, (2, 10))
    with kernels.mode("on"):
        assert _syncs(lambda: _step(model, idx)) == 0


@pytest.mark.parametrize("variant", variants.names())
def test_an_eager_step_never_waits_on_the_device(variant):
    """The one path every device runs asks the host nothing, eagerly too (LDM-RLS's guard is read once per optimizer
    step, by ``step_checks``, outside the step timed here)."""
    cfg, model = _model(variant, dtype=torch.float32)
    idx = torch.randint(cfg.model.vocab_size, (2, 10))
    _step(model, idx)  # warm-up: first calls may set things up
    assert _syncs(lambda: _step(model, idx)) == 0


@pytest.mark.slow
@pytest.mark.skipif(not (torch.cuda.is_available() or kernels.interpreting()), reason="the kernels need Triton")
@pytest.mark.parametrize("variant", variants.names())
def test_compiles_as_one_graph_with_the_kernels_on_and_matches_the_plain_path(rng_seed, variant):
    """With the fused kernels on, dynamo traces each model as one graph through the kernels' launches. On a CPU the
    kernels run in Triton's interpreter, which inductor cannot generate code around, so the graph runs with
    ``aot_eager`` (the same graph and autograd split inductor would get); a card runs it with inductor."""
    pytest.importorskip("triton")
    cfg, model = _model(variant, dtype=torch.float32)
    idx = torch.randint(cfg.model.vocab_size, (2, 10))
    torch._dynamo.reset()
    with kernels.mode("on"):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = _step(compiled, idx)
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with kernels.mode("off"):
        want = _step(model, idx)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 1e-4 * scale
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert float((got_grads[name] - p.grad).abs().max()) <= 1e-4 * max(float(p.grad.abs().max()), 1e-6), name


def test_the_rls_guard_trips_on_the_device_and_the_compiled_model_goes_on_in_float64(rng_seed):
    """Eight writes into 2-wide keys with λ = 0.5 leave late writes' δ² near the ridge's 0.5⁸: below the float32
    floor. The compiled step cannot stop to ask; ``step_checks`` finds it afterwards and switches the whitening to
    float64. The same compiled model, still one graph, then steps again without waiting on the device, and its
    logits and gradients equal the float64 recursion's."""
    cfg, model = _model("ldm-rls(groups=16,key_dim=2,lambda=0.5)", n_blocks=4, dtype=torch.float32)
    idx = torch.randint(cfg.model.vocab_size, (2, 10))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _step(compiled, idx)
    note = model.mixer.step_checks()
    assert note is not None and "float64 from here on" in note
    assert model.mixer.whiten_dtype == torch.float64
    assert model.mixer.step_checks() is None  # read once: the minimum starts over

    model.zero_grad()
    got = []
    assert _syncs(lambda: got.append(_step(compiled, idx))) == 0
    assert model.mixer.step_checks() is None  # float64 kept its digits
    reference = copy.deepcopy(model).double()
    reference.mixer.impl = "recurrent"
    reference.zero_grad()
    want = _step(reference, idx)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-4, atol=1e-5)
    grads = dict(reference.named_parameters())
    for name, p in model.mixer.named_parameters():
        torch.testing.assert_close(p.grad.double(), grads["mixer." + name].grad, rtol=1e-3, atol=1e-5, msg=name)

    cfg, healthy = _model("ldm-rls(groups=4,lambda=1.0)", dtype=torch.float32)
    torch._dynamo.reset()
    _step(torch.compile(healthy, fullgraph=True, backend="aot_eager"), idx)
    assert healthy.mixer.step_checks() is None
    assert healthy.mixer.whiten_dtype == torch.float32
