"""LDM and LDM-RLS (spec §3–§5, §7): PreLN equivalence, the exact ridge solution, groups, forgetting, ω, gradients
and the mixing matrix, all in float64 on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from matrix_products import MatrixProducts

import variants
from harness import build_model, model_preset
from harness.model.decoder import Trace
from variants.ldm import SmallMLP
from variants.ops import rls as ldm_rls

D, L, T = 64, 4, 16


def _model(spec: str, **overrides):
    return build_model(model_preset("tiny", **overrides), spec).to(torch.float64)


def _mixer(spec: str, d: int = 16, n_layers: int = 5):
    return variants.build(spec, d_model=d, n_layers=n_layers).to(torch.float64)


@torch.no_grad()
def _randomize(mixer):
    """Move λ and ω away from their initial values, so every weight in the closed form differs. The parameters are
    drawn over their gain (``scalar_lr``, 10 by default), as the mixer stores them: drawn without it, λ and ω
    saturate, λ at 0.5 or 1 for every write of a group now and then, ω down to 1e-20, where the least-squares
    reference itself no longer resolves the memory to 1e-9."""
    gain = mixer.cfg.scalar_lr
    if hasattr(mixer, "theta"):
        mixer.theta.uniform_(-3.0, 3.0).div_(gain)
    if mixer.uses_memory and mixer.omega_on:
        for mlp in mixer.keys:
            mlp.fc2.weight[mixer.G * mixer.dk :].normal_().div_(gain)
            mlp.fc2.bias[mixer.G * mixer.dk :].normal_().div_(gain)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _brute_force_memory(keys, values, lambdas, omegas, alpha):
    """M after the last write as an explicit ridge least-squares problem, stacked rows solved by lstsq.

    keys (n, ..., k), values (n, ..., v), lambdas and omegas (n, ...): rows √(β_i ω_i) k_iᵀ with targets
    √(β_i ω_i) v_iᵀ, plus k ridge rows √(β_{-1}/α) e_jᵀ with target 0.
    """
    n, k = keys.shape[0], keys.shape[-1]
    rows, targets = [], []
    for i in range(n):
        beta = torch.ones_like(lambdas[0])
        for j in range(i + 1, n):
            beta = beta * lambdas[j]
        w = (beta * omegas[i]).sqrt().unsqueeze(-1)
        rows.append(w * keys[i])
        targets.append(w * values[i])
    beta_ridge = torch.ones_like(lambdas[0])
    for j in range(n):
        beta_ridge = beta_ridge * lambdas[j]
    ridge = (beta_ridge / alpha).sqrt()[..., None, None] * torch.eye(k, dtype=keys.dtype)
    A = torch.cat([torch.stack(rows, -2), ridge.expand(*keys.shape[1:-1], k, k)], -2)  # (..., n+k, k)
    B = torch.cat(
        [torch.stack(targets, -2), torch.zeros(*values.shape[1:-1], k, values.shape[-1], dtype=values.dtype)], -2
    )  # (..., n+k, v)
    return torch.linalg.lstsq(A, B).solution.transpose(-1, -2), A  # (..., v, k)


# -- spec §5: read=residual is PreLN ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["ldm(read=residual)", "ldm-rls(read=residual)"])
def test_read_residual_equals_preln(spec, rng_seed):
    preln = _model("preln")
    with torch.no_grad():
        for layer in preln.layers:
            layer.norm.weight.uniform_(0.5, 1.5)
    model = _model(spec)
    model.load_state_dict(preln.state_dict(), strict=True)
    idx = torch.randint(0, 512, (2, T))
    with torch.no_grad():
        assert torch.equal(model(idx), preln(idx))
    assert model.mixer.extra_params() == 0


# -- spec §4: the recursion is the exact ridge solution -------------------------------------------------------
@pytest.mark.parametrize("groups", [1, 4])
def test_rls_step_matches_brute_force_ridge_for_random_inputs(groups, rng_seed):
    n, b, dv, dk, alpha = 6, 3, 5, 4, 0.37
    keys = torch.randn(n, b, groups, dk, dtype=torch.float64)  # deliberately not unit length
    values = torch.randn(n, b, groups, dv, dtype=torch.float64)
    lambdas = torch.empty(n, groups, dtype=torch.float64).uniform_(0.3, 1.0)
    omegas = torch.empty(n, b, groups, dtype=torch.float64).uniform_(0.2, 1.8)
    M, P = None, ldm_rls.initial_inverse_covariance(alpha, (b, groups), dk, dtype=torch.float64, device="cpu")
    reference = ldm_rls.closed_form_memory(keys, values, lambdas[:, None], omegas, alpha)
    for i in range(n):
        M, P = ldm_rls.rls_write(M, P, keys[i], values[i], lambdas[i], omegas[i])
        lam = lambdas[: i + 1, None].expand(-1, b, -1)
        brute, A = _brute_force_memory(keys[: i + 1], values[: i + 1], lam, omegas[: i + 1], alpha)
        assert _rel(M, brute) < 1e-9
        assert _rel(reference[i], brute) < 1e-9
        assert _rel(P, torch.linalg.inv(A.mT @ A)) < 1e-9
        assert torch.equal(P, P.mT)
        assert torch.linalg.eigvalsh(P).min() > 0


@pytest.mark.parametrize("read", ["residual+memory", "memory"])
@pytest.mark.parametrize("groups", [1, 4])
def test_ldm_rls_memory_after_every_layer_is_closed_form(groups, read, rng_seed):
    alpha = 2.3
    mixer = _mixer(f"ldm-rls(groups={groups},alpha={alpha},read={read})")
    _randomize(mixer)
    mixer.trace = {}
    e = torch.randn(2, 3, 16, dtype=torch.float64)
    writes = [("embed", -1, e)] if read == "memory" else []
    with torch.no_grad():
        state = mixer.init_state(e)
        for layer in range(mixer.n_layers):
            mixer.read(state, layer)
            v = torch.randn_like(e)
            state = mixer.write(state, layer, v)
            writes.append(("layer", layer, v))
            keys = torch.stack([mixer.trace[("k", w)] for _, w, _ in writes])  # (n, b, t, g, k)
            values = torch.stack([val.unflatten(-1, (groups, 16 // groups)) for *_, val in writes])
            omegas = torch.stack([mixer.trace[("omega", w)] for _, w, _ in writes])  # (n, b, t, g)
            lambdas = torch.stack([mixer.trace[("lambda", w)] for _, w, _ in writes])  # (n, g)
            brute, A = _brute_force_memory(keys, values, lambdas[:, None, None].expand_as(omegas), omegas, alpha)
            assert _rel(state.M, brute) < 1e-9, f"layer {layer}"
            assert torch.equal(state.P, state.P.mT)
            assert torch.linalg.eigvalsh(state.P).min() > 0
            assert _rel(state.P, torch.linalg.inv(A.mT @ A)) < 1e-9
    assert lambdas.max() - lambdas.min() > 1e-3 and omegas.std() > 0.1  # the weights really vary


@pytest.mark.parametrize("write", ["outer", "rls"])
def test_groups_equal_independent_one_group_memories(write, rng_seed):
    G, d = 4, 16
    dv = d // G
    mixer = _mixer(f"ldm(write={write},groups={G},key_dim=3)", d=d)
    _randomize(mixer)
    mixer.trace = {}
    e = torch.randn(2, 3, d, dtype=torch.float64)
    single = [
        (None, ldm_rls.initial_inverse_covariance(1.0, (2, 3, 1), 3, dtype=torch.float64, device="cpu"))
        for _ in range(G)
    ]
    with torch.no_grad():
        state = mixer.init_state(e)
        for layer in range(mixer.n_layers):
            a = mixer.read(state, layer)
            if state.M is not None:
                q = F.normalize(mixer.queries[layer](state.x).unflatten(-1, (G, 3)), dim=-1)  # (b, t, g, k)
                for g in range(G):
                    Mg = single[g][0][..., 0, :, :]  # (b, t, v, k)
                    read_g = torch.einsum("btvk,btk->btv", Mg, q[..., g, :])
                    torch.testing.assert_close(
                        a[..., g * dv : (g + 1) * dv],
                        state.x[..., g * dv : (g + 1) * dv] + read_g,
                        rtol=1e-12,
                        atol=1e-12,
                    )
            v = torch.randn_like(e)
            state = mixer.write(state, layer, v)
            k = mixer.trace[("k", layer)]
            for g in range(G):
                kg, vg = k[..., g : g + 1, :], v[..., None, g * dv : (g + 1) * dv]  # (b, t, 1, k), (b, t, 1, v)
                M1, P1 = single[g]
                if write == "outer":
                    step = vg.unsqueeze(-1) * kg.unsqueeze(-2)
                    single[g] = (step if M1 is None else M1 + step, None)
                else:
                    lam = mixer.trace[("lambda", layer)][g : g + 1]
                    omega = mixer.trace[("omega", layer)][..., g : g + 1]
                    single[g] = ldm_rls.rls_write(M1, P1, kg, vg, lam, omega)
                torch.testing.assert_close(state.M[..., g, :, :], single[g][0][..., 0, :, :], rtol=1e-12, atol=1e-12)


# -- forgetting and importance --------------------------------------------------------------------------------
@pytest.mark.parametrize("lam", [0.6, 0.9, 1.0])
def test_rls_forgets_with_lambda_lt_1(lam, rng_seed):
    """Values written under one key are read back weighted λ^(age): older writes fade unless λ = 1."""
    n, dv, dk = 4, 8, 5
    k = F.normalize(torch.randn(dk, dtype=torch.float64), dim=0)
    values = torch.randn(n, dv, dtype=torch.float64)
    M, P = None, ldm_rls.initial_inverse_covariance(1.0, (), dk, dtype=torch.float64, device="cpu")
    lam_t, one = torch.tensor(lam, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    for i in range(n):
        M, P = ldm_rls.rls_write(M, P, k, values[i], lam_t, one)
    coef = torch.linalg.lstsq(values.T, M @ k).solution  # M k = Σ_i c_i v_i
    expected = torch.tensor([lam ** (n - 1 - i) for i in range(n)], dtype=torch.float64)
    torch.testing.assert_close(coef / coef[-1], expected, rtol=1e-9, atol=1e-12)
    if lam < 1:
        assert coef[0] < coef[-1]


def test_omega_off_gives_unit_weights_and_equals_zero_omega_outputs(rng_seed):
    off = _model("ldm-rls(groups=4,omega=off)")
    on = _model("ldm-rls(groups=4)")
    G, dk = 4, 16
    with torch.no_grad():  # same weights; ω outputs of the on-model are zero at init, so ω = 1 there too
        state = off.state_dict()
        for name, p in on.state_dict().items():
            src = state[name]
            p.copy_(src if p.shape == src.shape else torch.cat([src, p[G * dk :]]))
    assert off.mixer.keys[0].fc2.out_features == G * dk
    idx = torch.randint(0, 512, (2, T))
    trace = Trace()
    with torch.no_grad():
        y_off = off(idx, trace=trace)
        torch.testing.assert_close(on(idx), y_off, rtol=1e-12, atol=1e-12)
        assert all(torch.equal(v, torch.ones_like(v)) for (key, _), v in trace.mixer.items() if key == "omega")
        _randomize(on.mixer)
        assert _rel(on(idx), y_off) > 1e-6  # ω really enters the model when it is on


# -- gradients --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["ldm", "ldm-rls", "ldm-rls(read=memory)"])
def test_gradients_reach_every_parameter(spec, rng_seed):
    model = _model(spec)
    idx = torch.randint(0, 512, (2, T))
    F.cross_entropy(model(idx).flatten(0, 1), torch.randint(0, 512, (2 * T,))).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    mixer = model.mixer
    if mixer.rls:
        assert (mixer.theta.grad != 0).all()
        for mlp in mixer.keys:  # ω's outputs
            assert (mlp.fc2.weight.grad[mixer.G * mixer.dk :].abs().sum(-1) > 0).all()


# -- spec §7: the mixing matrix -----------------------------------------------------------------------------------
MIXING_SPECS = [
    "ldm",
    "ldm-rls",
    "ldm(groups=4,key_dim=6)",
    "ldm-rls(groups=1,alpha=0.5,lambda=0.7)",
    "ldm(read=memory)",
    "ldm-rls(read=memory,groups=4)",
    "ldm(residual_write=off,groups=4)",
    "ldm-rls(read=memory,residual_write=off,groups=2)",
    "ldm(read=residual)",
    "ldm-rls(read=residual)",
    "ldm(residual_write=off,qk_source=residual,groups=4)",
    "ldm-rls(qk_source=read)",
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", MIXING_SPECS)
def test_mixing_matrix_reproduces_layer_inputs(spec, rng_seed):
    model = _model(spec)
    _randomize(model.mixer)
    trace = Trace()
    with torch.no_grad():
        model(torch.randint(0, 512, (2, T)), trace=trace)
    c = model.mixer.mixing_matrix(trace)  # (b, t, L+1, L+1, g)
    G = c.shape[-1]
    assert c.shape == (2, T, L + 1, L + 1, G)
    src = torch.stack([trace.embed] + trace.outputs, 2).unflatten(-1, (G, D // G))  # (b, t, s, g, v)
    for reader, target in enumerate(trace.inputs + [trace.head_input]):
        rebuilt = torch.einsum("bsg,bsgv->bgv", c[:, :, reader].flatten(0, 1), src.flatten(0, 1))
        torch.testing.assert_close(rebuilt.flatten(-2), target.flatten(0, 1), rtol=1e-10, atol=1e-10)


# -- precision and costs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["ldm", "ldm-rls(read=memory)", "ldm-rls(residual_write=off,groups=4)"])
def test_memory_math_stays_float32_under_bf16(spec, rng_seed):
    model = build_model(model_preset("tiny"), spec)
    idx = torch.randint(0, 512, (2, T))
    trace = Trace()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(idx, trace=trace)
    assert all(v.dtype == torch.float32 for v in trace.mixer.values())
    assert torch.isfinite(y).all()
    model = model.to(torch.bfloat16)  # bf16 parameters too: keys and the memory are still float32
    trace = Trace()
    with torch.no_grad():
        assert torch.isfinite(model(idx, trace=trace).float()).all()
    assert all(v.dtype == torch.float32 for v in trace.mixer.values())


@pytest.mark.parametrize("spec", ["ldm", "ldm-rls", "ldm-rls(qk_source=read)"])
def test_key_and_query_networks_precision_under_autocast(spec, rng_seed):
    """Under bf16 autocast the trunk's linear layers and the query networks multiply in bf16 (tensor cores on a
    card), and so do LDM's key networks; LDM-RLS's key networks multiply in float32, since its writes are whitened
    against each other (tests/test_rls_float32.py). The depth reads and the whitening stay float32."""
    model = build_model(model_preset("tiny"), spec)
    keys = len(model.mixer.keys)
    queries = sum(isinstance(q, SmallMLP) for q in model.mixer.queries)
    products = MatrixProducts()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), products:
        model(torch.randint(0, 512, (2, T)))
    float32 = products.seen["2d"].count(torch.float32)
    assert float32 == (2 * keys if model.mixer.rls else 0)  # fc1 and fc2 of each key network
    bf16 = products.seen["2d"].count(torch.bfloat16)
    assert bf16 == len(products.seen["2d"]) - float32 >= 2 * queries + (0 if model.mixer.rls else 2 * keys)
    assert products.seen["batched"] and set(products.seen["batched"]) == {torch.float32}


@pytest.mark.parametrize(
    "spec, floats",
    [
        ("ldm", D + 16 * 4 * 4),
        ("ldm-rls", D + 16 * 4 * 4 + 16 * 4 * 4),
        ("ldm(groups=4,key_dim=8)", D + 4 * 16 * 8),
        ("ldm-rls(groups=2,key_dim=3)", D + 2 * 32 * 3 + 2 * 9),
        ("ldm-rls(read=residual)", D),
    ],
)
def test_costs(spec, floats):
    mixer = variants.build(spec, d_model=D, n_layers=L)
    assert mixer.stream_floats_per_token() == floats
    if not mixer.uses_memory:
        assert mixer.extra_flops_per_token() == 0 and mixer.extra_params() == 0
        return
    n_mlps = sum(isinstance(m, SmallMLP) for m in [*mixer.keys, *mixer.queries])
    # The MLP matmuls alone are a floor for the count.
    assert mixer.extra_flops_per_token() > n_mlps * 2 * D * mixer.cfg.qk_hidden
    assert mixer.extra_params() == sum(p.numel() for p in mixer.parameters()) > 0


# -- the mixing weights against the definitions, by brute force ---------------------------------------------------
def _definition_mlp(mlp, x):
    """``RMSNorm → Linear → SiLU → Linear`` (spec §3) from the module's weights."""
    xn = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * mlp.norm.weight
    return F.silu(xn @ mlp.fc1.weight.T + mlp.fc1.bias) @ mlp.fc2.weight.T + mlp.fc2.bias


def _beta(lambdas: list, first: int):
    """``Π_{j ≥ first} λ_j`` over the writes so far: ``β_{n,first-1}`` after the last write ``n`` (1 when empty)."""
    return torch.prod(torch.stack(lambdas[first:])) if lambdas[first:] else 1.0


def _definition_forward(model, idx):
    """Every reader's input and the weights ``c[l, i, g]`` from the definitions of spec §3–§5 and §7, in float64:
    ``q_lᵀ k_i`` for the outer product, ``ω_i β_{l-1,i} k_iᵀ P_{l-1} q_l`` for RLS with ``P_{l-1}`` the explicit inverse
    of the weighted, forgotten, ridge key covariance, and the residual's ones. Queries and keys come from ``x_{l-1}``,
    or with ``qk_source=read`` from the latest read (``a_{l-1}`` for a query, ``a_l`` for layer ``l``'s key)."""
    mixer, cfg = model.mixer, model.mixer.cfg
    G, dk, L, d = mixer.G, mixer.dk, model.n_layers, model.cfg.d_model
    dv = d // G
    e = model.embed(idx)
    b, t, _ = e.shape
    c = torch.zeros(b, t, L + 1, L + 1, G, dtype=torch.float64)
    memory = torch.zeros_like(c)  # the memory's part of c alone
    sources, writes, inputs = [e], [], []  # writes: (source, k (b, t, g, k), ω (b, t, g), λ (g,))

    def unit(z):
        return z / z.norm(dim=-1, keepdim=True)

    def key(n, src):
        z = _definition_mlp(mixer.keys[n], src)
        k = unit(z[..., : G * dk].unflatten(-1, (G, dk)))
        if not mixer.rls:
            return k, None, None
        gain = cfg.scalar_lr  # λ's and ω's logits are their parameters times the gain (spec §4, docs: scalar_lr)
        omega = 2 * torch.sigmoid(gain * z[..., G * dk :]) if cfg.omega else torch.ones(b, t, G, dtype=torch.float64)
        lam = (
            0.5 + 0.5 * torch.sigmoid(gain * mixer.theta[n])
            if cfg.lambda_ == "learned"
            else torch.full((G,), float(cfg.lambda_), dtype=torch.float64)
        )
        return k, omega, lam

    x = latest = e
    if cfg.read == "memory":
        writes.append((0, *key(0, e)))
    for reader in range(L + 1):
        if cfg.read != "memory":
            c[:, :, reader, 0] = 1.0
            if cfg.residual_write:
                c[:, :, reader, 1 : reader + 1] = 1.0
        if writes:
            q = unit(
                _definition_mlp(mixer.queries[reader], x if cfg.qk_source == "residual" else latest).unflatten(
                    -1, (G, dk)
                )
            )
            for g in range(G):
                for i, (s, k, omega, _) in enumerate(writes):
                    if not mixer.rls:
                        memory[:, :, reader, s, g] = (k[..., g, :] * q[..., g, :]).sum(-1)
                        continue
                    lams = [w[3][g] for w in writes]
                    cov = sum(
                        _beta(lams, j + 1) * w[2][..., g, None, None] * w[1][..., g, :, None] * w[1][..., g, None, :]
                        for j, w in enumerate(writes)
                    )
                    P = torch.linalg.inv(cov + _beta(lams, 0) / cfg.alpha * torch.eye(dk, dtype=torch.float64))
                    Pq = (P @ q[..., g, :, None])[..., 0]
                    memory[:, :, reader, s, g] = omega[..., g] * _beta(lams, i + 1) * (k[..., g, :] * Pq).sum(-1)
        c[:, :, reader] += memory[:, :, reader]
        a = torch.einsum(
            "btsg,btsgv->btgv", c[:, :, reader, : len(sources)], torch.stack(sources, 2).unflatten(-1, (G, dv))
        ).flatten(-2)
        inputs.append(a)
        if reader == L:
            break
        v = model.layers[reader](a)
        key_src = x if cfg.qk_source == "residual" else a
        writes.append((reader + 1, *key(reader + mixer.embed_write, key_src)))
        sources.append(v)
        latest = a
        if cfg.residual_write:
            x = x + v
    return inputs, c, memory


WEIGHT_SPECS = [
    "ldm",
    "ldm(groups=4,key_dim=8)",
    "ldm(groups=1,key_dim=8)",
    "ldm(read=memory,groups=2)",
    "ldm(residual_write=off,groups=4)",
    "ldm(residual_write=off,qk_source=residual,groups=4)",
    "ldm(qk_source=read,groups=8,key_dim=5)",
    "ldm-rls",
    "ldm-rls(groups=4,key_dim=8,alpha=0.5)",
    "ldm-rls(groups=1,key_dim=8,lambda=0.9)",
    "ldm-rls(read=memory,groups=2,key_dim=6,lambda=0.7)",
    "ldm-rls(residual_write=off,groups=4,alpha=2.0)",
    "ldm-rls(qk_source=read,omega=off,groups=8,key_dim=3)",
    "ldm-rls(read=memory,residual_write=off,groups=4)",
    "ldm-rls(groups=16,key_dim=6,lambda=0.99)",
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", WEIGHT_SPECS)
def test_mixing_weights_equal_the_definitions(spec, rng_seed):
    model = _model(spec)
    with torch.no_grad():
        for p in model.mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
        _randomize(model.mixer)
    idx = torch.randint(0, 512, (2, T))
    trace = Trace()
    with torch.no_grad():
        model(idx, trace=trace)
        c = model.mixer.mixing_matrix(trace)
        inputs, expected, memory = _definition_forward(model, idx)
    for reader, (got, want) in enumerate(zip(trace.inputs + [trace.head_input], inputs)):
        assert _rel(got, want) < 1e-10, f"reader {reader}"
    assert c.shape == expected.shape
    assert _rel(c, expected) < 1e-10
    assert memory.abs().amax(dim=(0, 1)).gt(1e-3).sum() >= model.n_layers  # every reader after the first holds some


# -- qk_source: what the query and key MLPs read -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ldm", "ldm-rls"])
def test_without_residual_write_reads_address_by_context_not_token(name, rng_seed):
    """With residual_write=off the residual stays the embedding: keys from it are the same for a token wherever it
    stands, keys from the reads (the default for this ablation) differ with what came before."""
    idx = torch.randint(0, 512, (1, T))
    idx[0, 9] = idx[0, 3]
    idx[0, 4:9] = (idx[0, :5] + 1) % 512  # a different context before the second occurrence
    keys = {}
    for qk in ("residual", "read"):
        model = _model(f"{name}(residual_write=off,qk_source={qk},groups=4)")
        _randomize(model.mixer)
        trace = Trace()
        with torch.no_grad():
            model(idx, trace=trace)
        keys[qk] = torch.stack([trace.mixer[("k", layer)][0] for layer in range(1, L)])  # (layers, t, g, k)
    torch.testing.assert_close(keys["residual"][:, 3], keys["residual"][:, 9], rtol=1e-12, atol=1e-12)
    assert _rel(keys["read"][:, 9], keys["read"][:, 3]) > 1e-3
    assert variants.build(f"{name}(residual_write=off)", d_model=D, n_layers=L).cfg.qk_source == "read"


def test_qk_source_read_with_residual_write_is_another_model(rng_seed):
    """qk_source=read also applies with the residual on: same weights, different addresses, different model."""
    a = _model("ldm-rls(groups=4)")
    b = _model("ldm-rls(groups=4,qk_source=read)")
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 512, (2, T))
    with torch.no_grad():
        assert _rel(b(idx), a(idx)) > 1e-6
