"""The dual form of LDM and LDM-RLS (the default path) against the recurrent reference of spec §3–§4: values and
gradients of whole models in float64 over the knob combinations, the whitened writes against a Cholesky factor,
the layer-by-layer memory, float32 and bf16 behaviour, and that no per-layer memory is kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import build_model, model_preset
from variants import ldm_rls

T, VOCAB = 12, 512

DUAL_SPECS = [
    "ldm",
    "ldm(groups=1)",
    "ldm(groups=4,key_dim=6)",
    "ldm(read=memory)",
    "ldm(residual_write=off,groups=4)",
    "ldm(read=memory,residual_write=off,groups=2)",
    "ldm-rls",
    "ldm-rls(groups=1)",
    "ldm-rls(groups=4,key_dim=3)",
    "ldm-rls(groups=2,alpha=0.3,lambda=0.7)",
    "ldm-rls(read=memory,groups=4)",
    "ldm-rls(omega=off,lambda=1.0)",
    "ldm-rls(residual_write=off,alpha=3.0)",
    "ldm-rls(read=memory,residual_write=off,omega=off,groups=8)",
    "ldm(qk_source=read,groups=4)",
    "ldm(residual_write=off,qk_source=residual)",
    "ldm-rls(qk_source=read,read=memory,groups=2,key_dim=8)",
    "ldm-rls(groups=2,key_dim=12,lambda=0.9)",
]


def _pair(spec: str, n_blocks: int = 2):
    """The same float64 model twice, dual and recurrent, with λ and ω moved off their initial values."""
    dual = build_model(model_preset("tiny", n_blocks=n_blocks), spec).to(torch.float64)
    mixer = dual.mixer
    with torch.no_grad():
        if hasattr(mixer, "theta"):
            mixer.theta.uniform_(-3.0, 3.0)
        if mixer.omega_on:
            for mlp in mixer.keys:
                mlp.fc2.weight[mixer.G * mixer.dk :].normal_()
                mlp.fc2.bias[mixer.G * mixer.dk :].normal_()
    recurrent = build_model(model_preset("tiny", n_blocks=n_blocks), spec).to(torch.float64)
    recurrent.load_state_dict(dual.state_dict())
    recurrent.mixer.impl = "recurrent"
    assert dual.mixer.impl == "dual"
    return dual, recurrent


def _loss(model, idx, targets):
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 1, 3], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("spec", DUAL_SPECS)
def test_dual_equals_recurrent_values_and_gradients(spec, chunk, rng_seed):
    """Over every write (chunk 0) and chunkwise: every fold, every read of a carried memory (for RLS every
    whitening against it) and every downdate in backward, against the recursion. With chunk 1 no write stays
    open; with chunk 3 over 6 layers (7 writes with read=memory) folds and open writes alternate."""
    dual, recurrent = _pair(spec, n_blocks=3 if chunk else 2)
    dual.mixer.chunk = chunk
    idx, targets = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(dual(idx), recurrent(idx), rtol=1e-10, atol=1e-12)
    _loss(dual, idx, targets).backward()
    _loss(recurrent, idx, targets).backward()
    grads = dict(recurrent.named_parameters())
    for name, p in dual.named_parameters():
        expected = grads[name].grad
        assert expected is not None and expected.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, expected, rtol=1e-8, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 3], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("spec", ["ldm(groups=4)", "ldm-rls(groups=4)", "ldm-rls(read=memory,groups=2,alpha=0.5)"])
def test_dual_state_holds_the_recurrent_memory_after_every_layer(spec, chunk, rng_seed):
    dual, recurrent = _pair(spec, n_blocks=4)
    dual.mixer.chunk = chunk
    e = torch.randn(2, 5, 64, dtype=torch.float64)
    with torch.no_grad():
        s_dual, s_rec = dual.mixer.init_state(e), recurrent.mixer.init_state(e)
        for layer in range(dual.n_layers):
            a = dual.mixer.read(s_dual, layer)
            torch.testing.assert_close(a, recurrent.mixer.read(s_rec, layer), rtol=1e-10, atol=1e-12)
            v = torch.randn_like(e)
            s_dual, s_rec = dual.mixer.write(s_dual, layer, v), recurrent.mixer.write(s_rec, layer, v)
            if chunk:  # the writes since the latest fold, and a carried memory once one was made
                writes = layer + 1 + dual.mixer.embed_write
                assert len(s_dual.keys) == writes % chunk and (s_dual.carried is None) == (writes < chunk)
            torch.testing.assert_close(s_dual.M, s_rec.M, rtol=1e-10, atol=1e-12)
            if dual.mixer.rls:
                torch.testing.assert_close(s_dual.P, s_rec.P, rtol=1e-10, atol=1e-10)
                assert torch.equal(s_dual.P, s_dual.P.mT)


@pytest.mark.parametrize("groups, key_dim, n", [(1, 5, 4), (3, 4, 7), (2, 16, 13)])
def test_whitened_writes_are_the_inverse_cholesky_factor(groups, key_dim, n, rng_seed):
    """k̃ = L⁻¹K and ṽ = L⁻¹V with K Kᵀ + D = L Lᵀ, for keys that are not unit vectors and more writes than key
    dimensions (a singular K Kᵀ); then Σ ṽ k̃ᵀ is the closed-form ridge memory."""
    b, dv, alpha = 3, 5, 0.7
    keys = torch.randn(n, b, groups, key_dim, dtype=torch.float64)
    values = torch.randn(n, b, groups, dv, dtype=torch.float64)
    lambdas = torch.empty(n, groups, dtype=torch.float64).uniform_(0.5, 1.0)
    omegas = torch.empty(n, b, groups, dtype=torch.float64).uniform_(0.1, 2.0)
    ridge = ldm_rls.ridge_diagonal(torch.cumprod(lambdas, 0)[:, None], omegas, alpha)  # (n, b, g)
    kt, vt = (), ()
    for i in range(n):
        k_i, v_i, _ = ldm_rls.whiten(keys[i], values[i], ridge[i], kt, vt)
        kt, vt = kt + (k_i,), vt + (v_i,)
    K, V = keys.movedim(0, -2), values.movedim(0, -2)  # (b, g, n, k), (b, g, n, v)
    chol = torch.linalg.cholesky(K @ K.mT + torch.diag_embed(ridge.movedim(0, -1)))
    torch.testing.assert_close(
        torch.stack(kt, -2), torch.linalg.solve_triangular(chol, K, upper=False), rtol=1e-9, atol=1e-11
    )
    torch.testing.assert_close(
        torch.stack(vt, -2), torch.linalg.solve_triangular(chol, V, upper=False), rtol=1e-9, atol=1e-11
    )
    memory = sum(v.unsqueeze(-1) * k.unsqueeze(-2) for k, v in zip(kt, vt))
    reference = ldm_rls.closed_form_memory(keys, values, lambdas[:, None], omegas, alpha)[-1]
    torch.testing.assert_close(memory, reference, rtol=1e-9, atol=1e-11)
    q = torch.randn(b, groups, key_dim, dtype=torch.float64)
    weights = ldm_rls.read_weights(K, ridge.movedim(0, -1), q)  # (b, g, n)
    torch.testing.assert_close(
        torch.einsum("bgn,bgnv->bgv", weights, V), torch.einsum("bgvk,bgk->bgv", reference, q), rtol=1e-9, atol=1e-11
    )


@pytest.mark.parametrize("spec", ["ldm", "ldm-rls", "ldm-rls(read=memory,groups=4)"])
def test_dual_keeps_no_per_layer_memory_for_backward(spec, rng_seed):
    """Nothing autograd saves in the dual form is wider than two MLP hidden layers, while the recurrent form saves
    the (b, t, g, v, k) memory (and the covariance) of every layer: that is where its extra memory went."""
    dual, recurrent = _pair(spec)
    # 3 × 7 tokens: every activation has a multiple of 21 elements, whatever its shape; no weight here has.
    e = torch.randn(3, 7, 64, dtype=torch.float64, requires_grad=True)

    def largest_saved(mixer):
        sizes = [0]

        def pack(t):
            if t.numel() % 21 == 0:  # activations; weights (and weights with norm gains folded in) aside
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            state = mixer.init_state(e)
            for layer in range(mixer.n_layers):
                state = mixer.write(state, layer, torch.tanh(mixer.read(state, layer)))
            mixer.read_head(state)
        return max(sizes)

    # The largest is the hidden layer a layer's query and key MLPs share, 2 × qk_hidden = 2d wide here.
    assert dual.mixer.cfg.qk_hidden == 64 == e.shape[-1]
    assert largest_saved(dual.mixer) <= 2 * e.numel()
    assert largest_saved(recurrent.mixer) >= e.numel() * dual.mixer.dk  # the check can fail


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ldm", "ldm-rls", "ldm-rls(read=memory,groups=4)"])
def test_float32_dual_is_close_to_float64_reference(spec, rng_seed):
    dual, recurrent = _pair(spec, n_blocks=4)
    idx = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        expected = recurrent(idx)
        got = dual.to(torch.float32)(idx)
    assert got.dtype == torch.float32
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("spec", ["ldm", "ldm-rls(read=memory)"])
def test_dual_state_stays_float32_under_bf16_and_float64_in_float64(spec, rng_seed):
    model = build_model(model_preset("tiny"), spec)
    e = torch.randn(2, T, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = model.mixer.init_state(e.bfloat16())
        for layer in range(model.n_layers):
            state = model.mixer.write(state, layer, model.layers[layer](model.mixer.read(state, layer)))
        assert model.mixer.read_head(state).dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in state.keys + state.values)
    model = model.to(torch.float64)
    with torch.no_grad():
        state = model.mixer.write(model.mixer.init_state(e.double()), 0, e.double())
    assert all(t.dtype == torch.float64 for t in state.keys + state.values)


@pytest.mark.slow
# -- the chunked read: writes folded into a carried memory every `chunk` writes ----------------------------------
@pytest.mark.parametrize("spec", ["ldm", "ldm-rls(groups=4)"])
def test_chunked_read_survives_a_second_backward_and_frees_its_memory(spec, monkeypatch, rng_seed):
    """A second backward through the retained graph rebuilds the carried memory the first one lowered, so two
    passes give exactly twice the gradient; and once the graph is gone, so is the memory (no reference cycle
    through the nodes that share it)."""
    import gc
    import weakref

    from variants.ops.depth_read import CarriedMemory

    model = build_model(model_preset("tiny", n_blocks=3), spec).to(torch.float64)
    model.mixer.chunk = 2
    idx = torch.randint(0, VOCAB, (2, 9))
    made = []
    original = CarriedMemory.__init__

    def tracked(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(CarriedMemory, "__init__", tracked)
    loss = model(idx).square().mean()
    monkeypatch.undo()
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-12, atol=1e-14, msg=name)
    assert len(made) == 1 and made[0]() is not None
    del loss
    gc.collect()
    assert made[0]() is None


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ldm(groups=4)", "ldm-rls(groups=4)"])
def test_chunked_float32_stays_close_to_the_float64_recursion_at_depth(spec, rng_seed):
    """Backward recovers each earlier memory by subtracting folded writes from a float32 sum: over 48 layers and
    24 folds the rounding that leaves must stay small, in values and in gradients."""
    dual, recurrent = _pair(spec, n_blocks=24)
    dual = dual.to(torch.float32)
    dual.mixer.chunk = 2
    idx, targets = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        want_logits = recurrent(idx)
        assert float((dual(idx).double() - want_logits).norm() / want_logits.norm()) < 1e-4
    _loss(dual, idx, targets).backward()
    _loss(recurrent, idx, targets).backward()
    grads = dict(recurrent.named_parameters())
    for name, p in dual.named_parameters():
        want = grads[name].grad
        assert float((p.grad.double() - want).norm() / want.norm()) < 1e-4, name


@pytest.mark.slow
def test_chunking_is_chosen_by_depth_and_key_width():
    """Shallow models read every write; deep ones with narrow keys fold them."""
    from variants import ldm as ldm_module

    def chunk(spec, n_blocks, d_model=256, n_heads=4):
        cfg = model_preset("small", n_blocks=n_blocks, d_model=d_model, n_heads=n_heads, vocab_size=VOCAB)
        return build_model(cfg, spec).mixer.chunk

    assert chunk("ldm", 4) == 0 and chunk("ldm", 12) == 0
    assert chunk("ldm", 16) == ldm_module.CHUNK and chunk("ldm", 24) == ldm_module.CHUNK
    assert chunk("ldm-rls", 24) == ldm_module.CHUNK and chunk("ldm-rls", 12) == 0
    assert chunk("ldm(groups=4)", 24) == 0  # d_k = 64: the carried memory costs 32 writes to read
    assert ldm_module.default_chunk(0, 16) == 0
