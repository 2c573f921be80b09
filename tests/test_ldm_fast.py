"""The dual form of LDM and LDM-RLS (the default path) against the recurrent reference of spec §3–§4: values and
gradients of whole models in float64 over the knob combinations, the whitened writes against a Cholesky factor,
the layer-by-layer memory, float32 and bf16 behaviour, and that no per-layer memory is kept for backward."""

from __future__ import annotations

import mpmath
import pytest
import torch
import torch.nn.functional as F

from harness import build_model, model_preset
from variants.ops import rls as ldm_rls

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
    gain = mixer.cfg.scalar_lr  # λ's and ω's logits are these parameters times the gain: drawn in logit units
    with torch.no_grad():
        if hasattr(mixer, "theta"):
            mixer.theta.uniform_(-3.0 / gain, 3.0 / gain)
        if mixer.omega_on:
            for mlp in mixer.keys:
                mlp.fc2.weight[mixer.G * mixer.dk :].normal_(std=1.0 / gain)
                mlp.fc2.bias[mixer.G * mixer.dk :].normal_(std=1.0 / gain)
    recurrent = build_model(model_preset("tiny", n_blocks=n_blocks), spec).to(torch.float64)
    recurrent.load_state_dict(dual.state_dict())
    recurrent.mixer.impl = "recurrent"
    assert dual.mixer.impl == "dual"
    return dual, recurrent


def _loss(model, idx, targets):
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("n_blocks", [1, 3])
@pytest.mark.parametrize("spec", DUAL_SPECS)
def test_dual_equals_recurrent_values_and_gradients(spec, n_blocks, rng_seed):
    """At 2 and 6 layers (3 and 7 writes with read=memory), every parameter's gradient included."""
    dual, recurrent = _pair(spec, n_blocks=n_blocks)
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
@pytest.mark.parametrize("spec", ["ldm(groups=4)", "ldm-rls(groups=4)", "ldm-rls(read=memory,groups=2,alpha=0.5)"])
def test_dual_state_holds_the_recurrent_memory_after_every_layer(spec, rng_seed):
    dual, recurrent = _pair(spec, n_blocks=4)
    e = torch.randn(2, 5, 64, dtype=torch.float64)
    with torch.no_grad():
        s_dual, s_rec = dual.mixer.init_state(e), recurrent.mixer.init_state(e)
        for layer in range(dual.n_layers):
            a = dual.mixer.read(s_dual, layer)
            torch.testing.assert_close(a, recurrent.mixer.read(s_rec, layer), rtol=1e-10, atol=1e-12)
            v = torch.randn_like(e)
            s_dual, s_rec = dual.mixer.write(s_dual, layer, v), recurrent.mixer.write(s_rec, layer, v)
            assert s_dual.n_writes == layer + 1 + dual.mixer.embed_write
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


PREFIXES = range(8, 49, 8)  # the reads checked: after every eighth of 48 writes


def _square_root_reads(keys, values, ridge, query):
    """The reads ``M_n q`` after the ``PREFIXES`` writes, through ``rls.whiten_square_root``, and the smallest
    margin: keys (r, n, k), values (r, n, v), ridge (r, n), query (r, k) -> reads (len(PREFIXES), r, v), margin."""
    n = keys.shape[1]
    writes, reads, margins = ((), (), ()), [], []
    for i in range(n):
        k, v, c, margin = ldm_rls.whiten_square_root(keys[:, i], values[:, i], ridge[:, i], i, n, writes)
        writes = tuple(w + (x,) for w, x in zip(writes, (k, v, c)))
        if i + 1 in PREFIXES:
            reads.append(sum(v * (k * query).sum(-1, keepdim=True) for k, v in zip(writes[0], writes[1])))
        margins.append(margin)
    return torch.stack(reads), float(min(margins))


def _exact_reads(keys, values, ridge, query, digits: int = 60):
    """The same reads by solving ``(K Kᵀ + D) r = K q`` in ``digits``-digit arithmetic."""
    with mpmath.workdps(digits):
        out = []
        for K, V, d, q in zip(keys.tolist(), values.tolist(), ridge.tolist(), query.tolist()):
            rows = []
            for n in PREFIXES:
                Km = mpmath.matrix(K[:n])
                gram = Km * Km.T + mpmath.diag([mpmath.mpf(x) for x in d[:n]])
                weights = mpmath.lu_solve(gram, Km * mpmath.matrix(q))
                rows.append([float(x) for x in mpmath.matrix(V[:n]).T * weights])
            out.append(rows)
    return torch.tensor(out, dtype=torch.float64).transpose(0, 1)


def _forgetting_writes(rows: int, n: int, key_dim: int, lam: float):
    """Unit keys, values, a query, and the ridge terms of ``n`` writes at a fixed λ with α = 0.1 and ω at 7e-4 or
    2 (half each, in a random order): the strongest forgetting the stress grid of ``test_rls_float32.py`` has."""
    keys = F.normalize(torch.randn(rows, n, key_dim, dtype=torch.float64), dim=-1)
    values = torch.randn(rows, n, 5, dtype=torch.float64)
    query = F.normalize(torch.randn(rows, key_dim, dtype=torch.float64), dim=-1)
    omega = torch.where(torch.arange(rows * n).remainder(2) == 0, 7e-4, 2.0)[torch.randperm(rows * n)]
    decay = torch.full((rows, n), lam, dtype=torch.float64).cumprod(-1)
    return keys, values, ldm_rls.ridge_diagonal(decay, omega.view(rows, n).double(), 0.1), query


@pytest.mark.parametrize("key_dim", [2, 4])
def test_square_root_whitening_keeps_the_digits_the_subtraction_loses(key_dim, rng_seed):
    """48 writes at λ = 0.45: ridge terms down to ~1e-16, below the margin at which ``whiten``'s subtraction keeps
    its digits even in float64 (it lost ~3e-4 of a read there). The square-root form's reads stay within 1e-11 of
    a 60-digit solve; and its k̃, ṽ are ``whiten``'s where that is accurate (few writes). At the stress grid's
    λ = 0.5, 4-wide keys keep every margin above that floor in about 1 draw of 100, outside the case tested here."""
    keys, values, ridge, query = _forgetting_writes(3, 48, key_dim, 0.45)
    reads, margin = _square_root_reads(keys, values, ridge, query)
    want = _exact_reads(keys, values, ridge, query)
    assert margin < ldm_rls.min_margin(torch.float64)  # where the subtraction is not to be trusted
    assert margin > ldm_rls.min_margin(torch.float64, square_root=True)
    error = (reads - want).norm(dim=-1) / want.norm(dim=-1)
    assert float(error.max()) < 1e-11
    few = (keys[:, :3], values[:, :3], ridge[:, :3])
    writes, kt, vt = ((), (), ()), (), ()
    for i in range(3):
        k, v, c, _ = ldm_rls.whiten_square_root(few[0][:, i], few[1][:, i], few[2][:, i], i, 3, writes)
        writes = tuple(w + (x,) for w, x in zip(writes, (k, v, c)))
        k_sub, v_sub, _ = ldm_rls.whiten(few[0][:, i], few[1][:, i], few[2][:, i], kt, vt)
        kt, vt = kt + (k_sub,), vt + (v_sub,)
        torch.testing.assert_close(k, k_sub, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, v_sub, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lam", [0.3, 0.25, 0.2])
def test_square_root_whitening_is_accurate_above_its_floor(lam, rng_seed):
    """``min_margin(float64, square_root=True)`` is the floor the guard holds the square-root form to: where the
    smallest margin is above it the reads are within 1e-5 of a 60-digit solve; the form loses digits as ε² / margin,
    so stronger forgetting (λ = 0.2 over 48 writes, ridge terms ~1e-33) falls below it and the guard must say so."""
    keys, values, ridge, query = _forgetting_writes(2, 48, 4, lam)
    reads, margin = _square_root_reads(keys, values, ridge, query)
    want = _exact_reads(keys, values, ridge, query)
    error = float(((reads - want).norm(dim=-1) / want.norm(dim=-1)).max())
    if margin >= ldm_rls.min_margin(torch.float64, square_root=True):
        assert error < 1e-5
    assert error < 100 * torch.finfo(torch.float64).eps ** 2 / margin
    if lam == 0.2:
        assert margin < ldm_rls.min_margin(torch.float64, square_root=True)


@pytest.mark.parametrize("spec", ["ldm(groups=1)", "ldm-rls(groups=1)", "ldm-rls(read=memory,groups=1)"])
def test_dual_keeps_no_per_layer_memory_for_backward(spec, rng_seed):
    """Nothing autograd saves in the dual form is wider than the writes so far stacked along depth (a read's
    keys or values), while the recurrent form saves the (b, t, g, v, k) memory (and the covariance) of every
    layer: with one group of d_k = d keys, d times the width of a write."""
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

    n_writes = dual.n_layers + dual.mixer.embed_write
    assert dual.mixer.dk == e.shape[-1] == 64 and n_writes <= 5
    assert largest_saved(dual.mixer) <= n_writes * e.numel()
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
    """LDM-RLS's keys and whitened values are float32 under bf16 autocast; LDM's values are the sublayers' bf16
    outputs, kept as they came, with its keys rounded to bf16 beside them, and its reads equal those of the same
    keys and values widened to float32."""
    model = build_model(model_preset("tiny"), spec)
    e = torch.randn(2, T, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = model.mixer.init_state(e.bfloat16())
        for layer in range(model.n_layers):
            state = model.mixer.write(state, layer, model.layers[layer](model.mixer.read(state, layer)))
        head = model.mixer.read_head(state)
        assert head.dtype == torch.bfloat16
        if state.buffer is not None:
            buffer = state.buffer._replace(slots=tuple(t.float() for t in state.buffer.slots))
            widened = state._replace(buffer=buffer)
        else:
            widened = state._replace(
                keys=tuple(k.float() for k in state.keys), values=tuple(v.float() for v in state.values)
            )
        assert torch.equal(model.mixer.read_head(widened), head)
    outer = spec == "ldm"
    assert all(t.dtype == (torch.bfloat16 if outer else torch.float32) for t in _writes(state))
    model = model.to(torch.float64)
    with torch.no_grad():
        state = model.mixer.write(model.mixer.init_state(e.double()), 0, e.double())
    assert all(t.dtype == torch.float64 for t in _writes(state))


def _writes(state) -> tuple[torch.Tensor, ...]:
    """The stored keys and values of a dual state: a depth buffer's, or RLS's whitened writes."""
    if state.buffer is not None:
        return state.buffer.slots
    return state.keys + state.values


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("spec", ["ldm", "ldm(groups=4,key_dim=8)", "ldm(read=memory)"])
def test_bf16_keys_stay_near_the_float32_recursions_error(spec, rng_seed):
    """Under bf16 autocast LDM keeps its keys in bf16 beside its values: its logits are within 1.25 times the error
    against float64 of the recursion, which keeps keys and memory in float32 under the same autocast, and where
    the read adds to the stream within 1.25 times PreLN's own bf16 error on the same decoder. Over 200 draws the
    largest were 1.13 (median 1.00) and 1.10 times."""
    dual, recurrent = _pair(spec, n_blocks=6)
    preln = build_model(model_preset("tiny", n_blocks=6), "preln").to(torch.float64)
    preln.load_state_dict({k: v for k, v in dual.state_dict().items() if not k.startswith("mixer.")})
    idx = torch.randint(0, VOCAB, (2, 32))
    errors = {}
    for name, model in (("dual", dual), ("recurrent", recurrent), ("preln", preln)):
        with torch.no_grad():
            want = model(idx)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                errors[name] = _relative(model.float()(idx), want)
    assert 0 < errors["dual"] <= 1.25 * errors["recurrent"]
    if dual.mixer.cfg.read == "residual":
        assert errors["dual"] <= 1.25 * errors["preln"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ldm(groups=4)", "ldm-rls(groups=4)", "ldm-rls(groups=4,scalar_lr=1)"])
def test_float32_stays_close_to_the_float64_recursion_at_depth(spec, rng_seed):
    """Over 48 layers the float32 rounding of the reads (and RLS's whitening) must stay small, in values and in
    gradients: where forgetting this strong costs the whitening its float32 digits, the guard says so after the step
    (which training then skips) and the next step whitens in float64."""
    dual, recurrent = _pair(spec, n_blocks=24)
    dual = dual.to(torch.float32)
    idx, targets = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        want_logits = recurrent(idx)
        got = dual(idx)
        if dual.mixer.step_checks() is not None:
            assert dual.mixer.whiten_dtype == torch.float64
            got = dual(idx)
        assert float((got.double() - want_logits).norm() / want_logits.norm()) < 1e-4
    _loss(dual, idx, targets).backward()
    _loss(recurrent, idx, targets).backward()
    grads = dict(recurrent.named_parameters())
    for name, p in dual.named_parameters():
        want = grads[name].grad
        assert float((p.grad.double() - want).norm() / want.norm()) < 1e-4, name
