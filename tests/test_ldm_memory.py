"""LDM's dual form keeps no query for backward, and LDM-RLS no raw key: each layer's query/key pass (``MLPPass``)
is recomputed once in backward, and the read (and RLS's whitening) of the same layer take their query (and raw
key) from that recomputation.

Values and gradients must be the forward's to the bit, with and without the handle, for every write and read
form, through a second backward and under a caller's saved-tensor hooks; and the peak memory of a step must fall
by the queries no longer kept. Below, what else LDM-RLS no longer holds: the carried memory after the head's read,
what only a second backward would need, the whitening's coefficients and ``S k``, and the raw keys the float64
hand-over reads.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F

from harness import build_model, model_preset
from harness.benchmarks.memory import cpu_peak_allocated_bytes
from variants import ldm as ldm_module

SPECS = ["ldm", "ldm-rls", "ldm(read=memory)", "ldm(qk_source=read)", "ldm(residual_write=off)", "ldm+chunk"]


def _model(spec: str, n_blocks: int = 5):
    spec, chunked = spec.removesuffix("+chunk"), spec.endswith("+chunk")
    model = build_model(model_preset("tiny", n_blocks=n_blocks), spec)
    if chunked:
        model.mixer.chunk = 3
    with torch.no_grad():  # away from the initialization
        for p in model.mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _keep_queries(monkeypatch):
    """Reads keep their query as autograd would, instead of the handle to the recomputation."""
    monkeypatch.setattr(ldm_module.MLPPass, "keeping", lambda self, q: contextlib.nullcontext())


def _loss_and_grads(model, idx, targets, *, twice=False):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward(retain_graph=twice)
    if twice:
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_recomputed_queries_give_the_forward_and_gradients_of_kept_ones(spec, monkeypatch, rng_seed):
    model = _model(spec)
    idx, targets = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    loss, got = _loss_and_grads(model, idx, targets)
    _, twice = _loss_and_grads(model, idx, targets, twice=True)
    with torch.autograd.graph.save_on_cpu():
        _, hooked = _loss_and_grads(model, idx, targets)
    with monkeypatch.context() as m:
        _keep_queries(m)
        want_loss, want = _loss_and_grads(model, idx, targets)
    assert torch.equal(loss, want_loss)
    for g, w, t, h in zip(got, want, twice, hooked):
        assert torch.equal(g, w)
        assert torch.equal(h, w)
        torch.testing.assert_close(t, 2 * w, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ldm", "ldm-rls"])
def test_peak_memory_of_a_step_falls_with_the_queries_not_kept(spec, monkeypatch, rng_seed):
    model = _model(spec, n_blocks=8)  # L = 16: readers 1..16 each made a query
    b, t = 4, 64
    idx, targets = torch.randint(0, 512, (b, t)), torch.randint(0, 512, (b, t))
    mixer = model.mixer
    query_bytes = b * t * mixer.G * mixer.dk * 4

    def peak():
        model.zero_grad(set_to_none=True)
        gc.collect()
        return cpu_peak_allocated_bytes(lambda: F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward())

    recomputed = peak()
    with monkeypatch.context() as m:
        _keep_queries(m)
        kept = peak()
    # At the peak (the start of backward) every reader's query was held; now one is recomputed at a time.
    assert kept - recomputed >= 12 * query_bytes


def test_a_pass_without_autograd_keeps_nothing(rng_seed):
    model = _model("ldm")
    with torch.no_grad():
        state = model.mixer.init_state(torch.randn(2, 16, model.cfg.d_model))
        model.mixer.read(state, 0)
        state = model.mixer.write(state, 0, torch.randn(2, 16, model.cfg.d_model))
    assert state.tape is None
    mlp_pass = ldm_module.MLPPass([model.mixer.queries[1]])
    with torch.no_grad():
        mlp_pass.run(torch.randn(2, 16, model.cfg.d_model))
    assert mlp_pass.x is None and mlp_pass.graph is None and not mlp_pass.recomputes


# -- LDM-RLS: the carried memory, the whitening and the hand-over's raw keys -------------------------------------
def _rls(chunk: int, n_blocks: int = 4):
    model = _model("ldm-rls(groups=4)", n_blocks=n_blocks)
    model.mixer.chunk = chunk
    return model


def _tracked(monkeypatch, cls):
    """Every instance of ``cls`` made while the returned list is open."""
    made, original = [], cls.__init__

    def tracked(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", tracked)
    return made


@pytest.mark.slow
def test_carried_memory_is_let_go_after_the_head_and_rebuilt_for_backward(monkeypatch, rng_seed):
    """Nothing reads the carried memory after the head's read, so the forward pass ends without it; backward
    rebuilds it from the folded writes, bit for bit the memory the forward pass read."""
    from variants.ops.depth_read import CarriedMemory

    model = _rls(chunk=2)
    idx, targets = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    with monkeypatch.context() as m:
        made = _tracked(m, CarriedMemory)
        logits = model(idx)
    (memory,) = made
    assert memory.folds >= 2 and memory.M is None and memory.S is None and memory.MS is None
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    got = [p.grad.clone() for p in model.parameters()]
    with monkeypatch.context() as m:
        m.setattr(CarriedMemory, "release", lambda self: None)
        _, want = _loss_and_grads(model, idx, targets)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 2])
def test_a_backward_that_drops_the_graph_lets_go_of_what_only_a_second_one_needs(chunk, monkeypatch, rng_seed):
    """The graph's nodes live until the step ends, and with them what they hold outside their saved tensors: each
    query/key pass's input and the carried memory's folded writes are let go of once their own backward has run,
    unless the graph is kept for another backward (which test_recomputed_queries… runs)."""
    from variants.ops.depth_read import CarriedMemory

    model = _rls(chunk)
    idx, targets = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    with monkeypatch.context() as m:
        passes, memories = _tracked(m, ldm_module.MLPPass), _tracked(m, CarriedMemory)
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    assert passes and all(p.x is not None for p in passes)
    assert len(memories) == (1 if chunk else 0)
    loss.backward(retain_graph=True)
    assert all(p.x is not None for p in passes) and all(c is not None for m in memories for c in m.chunks)
    loss.backward()
    assert all(p.x is None for p in passes) and all(c is None for m in memories for c in m.chunks)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 2])
def test_the_whitening_keeps_no_coefficients_and_no_gram_product(chunk, rng_seed):
    """Per write the whitening keeps the whitened key and value (every later read needs them) and its δ: not the
    coefficients ``l_j`` (one (b, t, g, 1) tensor per pair of writes) nor ``S k`` (one (b, t, g, k) per write),
    which backward makes again."""
    model = _rls(chunk, n_blocks=5)
    b, t, G, dk = 2, 16, model.mixer.G, model.mixer.dk
    saved: dict[int, tuple] = {}

    def pack(x):
        saved.setdefault(x.untyped_storage().data_ptr(), (tuple(x.shape), x.dtype))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(torch.randint(0, 512, (b, t)))
    n_writes = model.mixer.n_layers + 1
    deltas = [s for s, dt in saved.values() if s == (b, t, G, 1) and dt.is_floating_point]
    keys = [s for s, dt in saved.values() if s == (b, t, G, dk)]
    assert len(deltas) == n_writes - 1  # the first write projects nothing out: its δ is its own norm
    assert len(keys) <= 2 * n_writes  # whitened keys and values (here v = k wide), nothing per pair


def test_the_hand_over_makes_its_raw_keys_again(rng_seed):
    """LDM-RLS keeps each write's raw key for the float64 hand-over as a way to make it again, not as a tensor
    held through the forward pass; made again, it is the key the pass gave, bit for bit, and carries the
    gradient to the pass's input (the hand-over tests in test_rls_float32 check the gradients whole)."""
    model = _rls(0)
    mixer = model.mixer
    e = torch.randn(2, 16, model.cfg.d_model, requires_grad=True)
    seen = []
    original = mixer._key

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out[0])
        return out

    mixer._key = recording
    try:
        state = mixer.init_state(e)
        for layer in range(3):
            state = mixer.write(state, layer, torch.tanh(mixer.read(state, layer)))
    finally:
        del mixer._key
    assert len(state.raw) == len(seen) >= 3 and all(isinstance(r[0], ldm_module.RawKey) for r in state.raw)
    for (raw_key, *_), kept in zip(state.raw, seen):
        again = raw_key()
        assert torch.equal(again, kept) and again.grad_fn is not None
    (grad,) = torch.autograd.grad(state.raw[0][0]().sum(), e)
    assert grad.abs().sum() > 0
