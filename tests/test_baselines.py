"""The published baselines (spec §6) against their definitions, in float64 on fresh random weights and tokens.

Each reference below is recomputed from the recorded layer outputs with plain matrix algebra, independently of
the variant's own code: AttnRes (full and block) as a softmax over hand-built sources, HC and mHC as explicit
per-layer matrix products; the degenerate settings (one-stream HC, DenseFormer at init) must equal PreLN bit
for bit given the same decoder weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from matrix_products import MatrixProducts

import variants
from harness import UsageError, build_model, model_preset
from harness.model.decoder import Trace

T = 16


def _model(spec: str, n_blocks: int = 2):
    return build_model(model_preset("tiny", n_blocks=n_blocks), spec).to(torch.float64).eval()


def _traced(model, batch: int = 2):
    idx = torch.randint(0, model.cfg.vocab_size, (batch, T))
    trace = Trace()
    with torch.no_grad():
        logits = model(idx, trace=trace)
    return idx, logits, trace


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm())


def _same_decoder(spec: str, reference):
    """A model of ``spec`` whose decoder weights are those of ``reference`` (mixer weights at their init)."""
    model = _model(spec, reference.cfg.n_blocks)
    decoder = {k: v for k, v in reference.state_dict().items() if not k.startswith("mixer.")}
    missing, unexpected = model.load_state_dict(decoder, strict=False)
    assert not unexpected and all(k.startswith("mixer.") for k in missing)
    return model


def _rms_keys(x):
    return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()


def test_attnres_with_zero_queries_averages_all_earlier_outputs(rng_seed):
    model = _model("attnres")
    assert not model.mixer.queries.any()
    _, _, trace = _traced(model)
    sources = [trace.embed] + trace.outputs
    for l, a in enumerate(trace.inputs + [trace.head_input]):
        expected = torch.stack(sources[: l + 1]).mean(0)
        assert _rel(a, expected) < 1e-12, f"reader {l}"


@pytest.mark.parametrize("block_size", [2, 3])
def test_attnres_block_matches_a_softmax_over_block_sums(block_size, rng_seed):
    model = _model(f"attnres-block(block_size={block_size})", n_blocks=3)
    with torch.no_grad():
        model.mixer.queries.normal_(0.0, 1.0)
    _, _, trace = _traced(model)
    L, v = model.n_layers, trace.outputs
    for reader, a in enumerate(trace.inputs + [trace.head_input]):
        n_done = reader // block_size
        sources = [trace.embed] + [sum(v[n * block_size : (n + 1) * block_size]) for n in range(n_done)]
        if reader % block_size:
            sources.append(sum(v[n_done * block_size : reader]))
        src = torch.stack(sources, dim=-2)  # (b, t, s, d)
        if len(sources) == 1:
            expected = src[..., 0, :]
        else:
            w = torch.softmax(_rms_keys(src) @ model.mixer.queries[reader - 1], dim=-1)  # (b, t, s)
            expected = (w.unsqueeze(-1) * src).sum(-2)
        assert _rel(a, expected) < 1e-12, f"reader {reader} of {L}"


@pytest.mark.slow
def test_attnres_block_of_one_layer_equals_full_attnres(rng_seed):
    full = _model("attnres", n_blocks=3)
    with torch.no_grad():
        full.mixer.queries.normal_(0.0, 1.0)
    block = _model("attnres-block(block_size=1)", n_blocks=3)
    block.load_state_dict(full.state_dict())
    idx = torch.randint(0, full.cfg.vocab_size, (2, T))
    with torch.no_grad():
        assert _rel(block(idx), full(idx)) < 1e-12


@pytest.mark.parametrize("spec", ["hc(expansion=1)", "hc(expansion=1,dynamic=off)", "denseformer"])
def test_degenerate_baselines_equal_preln_exactly_at_init(spec, rng_seed):
    preln = _model("preln", n_blocks=3)
    other = _same_decoder(spec, preln)
    idx = torch.randint(0, preln.cfg.vocab_size, (2, T))
    with torch.no_grad():
        assert torch.equal(other(idx), preln(idx))


def test_hc_dynamic_matches_explicit_matrix_products(rng_seed):
    model = _model("hc(expansion=3)")
    mixer, n = model.mixer, 3
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    _, _, trace = _traced(model)
    H = trace.embed.unsqueeze(-2).repeat(1, 1, n, 1)  # (b, t, n, d)
    for l, (a, v) in enumerate(zip(trace.inputs, trace.outputs)):
        z = torch.tanh(_rms_keys(H) @ mixer.proj[l])  # (b, t, n, n + 2)
        s_alpha, s_beta = mixer.scale[l]
        am = mixer.static_am[l] + s_alpha * z[..., 0]
        ar = mixer.static_ar[l] + s_alpha * z[..., 1 : n + 1]
        bw = mixer.static_b[l] + s_beta * z[..., n + 1]
        assert _rel(a, (am.unsqueeze(-2) @ H).squeeze(-2)) < 1e-12, f"layer {l}"
        H = ar.transpose(-1, -2) @ H + bw.unsqueeze(-1) * v.unsqueeze(-2)
    assert _rel(trace.head_input, H.sum(-2)) < 1e-12


@pytest.mark.parametrize("dynamic", ["on", "off"])
def test_hc_builds_and_runs_with_dynamic_on_and_off(dynamic, rng_seed):
    model = _model(f"hc(dynamic={dynamic})")
    _, logits, _ = _traced(model)
    assert torch.isfinite(logits).all()
    assert hasattr(model.mixer, "proj") == (dynamic == "on")
    assert variants.canonical(f"hc(dynamic={dynamic})") == ("hc" if dynamic == "on" else "hc(dynamic=off)")


def _check_mhc_coefficients(pre, post, res):
    assert (pre > 0).all() and (pre < 1).all()
    assert (post > 0).all() and (post < 2).all()
    assert (res >= 0).all()
    assert (res.sum(-1) - 1).abs().max() < 1e-12  # rows: the last normalization
    assert (res.sum(-2) - 1).abs().max() < 1e-3  # columns: converged within the default iterations


def test_mhc_coefficients_at_init_are_constrained_and_near_preln(rng_seed):
    model = _model("mhc")
    _, _, trace = _traced(model)
    for l in range(model.n_layers):
        pre, res, post = (trace.mixer[(k, l)] for k in ("pre", "res", "post"))
        _check_mhc_coefficients(pre, post, res)
        eye = torch.eye(res.shape[-1], dtype=res.dtype)
        assert (res - eye).abs().max() < 2e-3, "H_res should start near the identity"


@torch.no_grad()
def test_mhc_coefficients_on_random_unit_scale_inputs(rng_seed):
    mixer = _model("mhc").mixer
    X = torch.randn(3, 5, mixer.n, mixer.d_model, dtype=torch.float64)
    for l in range(mixer.n_layers):
        _check_mhc_coefficients(*mixer.coefficients(X, l))


@torch.no_grad()
def test_mhc_residual_mixing_is_a_rescaled_exponential(rng_seed):
    mixer = _model("mhc").mixer
    n = mixer.n
    mixer.alpha.fill_(1.0)  # unit-scale logits, far from the initialization
    mixer.bias.normal_(0.0, 1.0)
    X = torch.randn(3, 5, n, mixer.d_model, dtype=torch.float64)
    for l in range(mixer.n_layers):
        _, _, res = mixer.coefficients(X, l)
        assert (res > 0).all() and (res.sum(-1) - 1).abs().max() < 1e-12
        # Sinkhorn only rescales rows and columns: res / exp(logits) must be an outer product r c^T.
        logits = (_rms_keys(X.flatten(-2)) @ mixer.phi[l][:, 2 * n :] + mixer.bias[l, 2 * n :]).view(3, 5, n, n)
        ratio = res / logits.exp()
        outer = ratio[..., :, :1] * ratio[..., :1, :] / ratio[..., :1, :1]
        assert _rel(ratio, outer) < 1e-10


def test_mhc_matches_explicit_matrix_products(rng_seed):
    model = _model("mhc(expansion=2,sinkhorn_iters=5)")
    mixer, n = model.mixer, 2
    with torch.no_grad():
        mixer.alpha.uniform_(0.5, 1.0)
        mixer.bias.add_(0.5 * torch.randn_like(mixer.bias))
    _, _, trace = _traced(model)
    X = trace.embed.unsqueeze(-2).repeat(1, 1, n, 1)  # (b, t, n, d)
    for l, (a, v) in enumerate(zip(trace.inputs, trace.outputs)):
        z = _rms_keys(X.flatten(-2)) @ mixer.phi[l]
        alpha, bias = mixer.alpha[l], mixer.bias[l]
        pre = torch.sigmoid(alpha[0] * z[..., :n] + bias[:n])
        post = 2 * torch.sigmoid(alpha[1] * z[..., n : 2 * n] + bias[n : 2 * n])
        m = (alpha[2] * z[..., 2 * n :] + bias[2 * n :]).exp().view(*z.shape[:-1], n, n)
        for _ in range(5):
            m = m / m.sum(-2, keepdim=True)
            m = m / m.sum(-1, keepdim=True)
        assert _rel(a, (pre.unsqueeze(-2) @ X).squeeze(-2)) < 1e-12, f"layer {l}"
        X = m @ X + post.unsqueeze(-1) * v.unsqueeze(-2)
    assert _rel(trace.head_input, X.sum(-2)) < 1e-12


def test_denseformer_averages_block_outputs_with_its_weights(rng_seed):
    model = _model("denseformer", n_blocks=3)
    with torch.no_grad():
        for p in model.mixer.alphas:
            p.normal_(0.0, 1.0)
    _, _, trace = _traced(model)
    v, alphas = trace.outputs, model.mixer.alphas
    x, block_outputs = trace.embed, [trace.embed]
    for block in range(3):
        assert _rel(trace.inputs[2 * block], x) < 1e-12
        x = x + v[2 * block]
        assert _rel(trace.inputs[2 * block + 1], x) < 1e-12
        block_outputs.append(x + v[2 * block + 1])
        x = sum(w * X for w, X in zip(alphas[block], block_outputs))
    assert _rel(trace.head_input, x) < 1e-12


@pytest.mark.parametrize("spec", ["attnres", "attnres-block", "hc", "mhc", "denseformer"])
def test_mixing_weights_stay_float32_under_bf16_autocast(spec, rng_seed):
    model = build_model(model_preset("tiny"), spec)
    idx = torch.randint(0, model.cfg.vocab_size, (2, T))
    trace = Trace()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx, trace=trace)
        c = model.mixer.mixing_matrix(trace)
    assert torch.isfinite(logits).all()
    assert c.dtype == torch.float32
    assert all(value.dtype == torch.float32 for value in trace.mixer.values())


@pytest.mark.parametrize(
    "spec, allowed",
    [
        ("hc(expansion=0)", "at least 1"),
        ("mhc(sinkhorn_iters=0)", "at least 1"),
        ("attnres-block(block_size=0)", "at least 1"),
        ("hc(dynamic=maybe)", "on or off"),
    ],
)
def test_bad_knobs_name_the_allowed_values(spec, allowed):
    with pytest.raises(UsageError, match=allowed):
        variants.validate(spec)


def _randomize_connections(model, spec: str):
    """Dynamic weights far from their init, so the connections' projection shapes every layer's mixing."""
    with torch.no_grad():
        if spec == "hc":
            model.mixer.proj.normal_(0.0, model.cfg.d_model**-0.5)
            model.mixer.scale.uniform_(0.1, 0.3)
        else:
            model.mixer.alpha.uniform_(0.5, 1.5)
            model.mixer.bias.normal_()


@pytest.mark.parametrize("spec, projection", [("mhc", torch.bfloat16), ("hc", torch.float32)])
def test_connections_projection_precision_keeps_bf16_error_at_prelns(spec, projection, rng_seed):
    """Under bf16 autocast mHC's projection multiplies in bf16, like the trunk's linear layers (tensor cores on a
    card): its doubly stochastic ``H^res`` averages streams that differ little, so the rounding of its logits stays
    at PreLN's own bf16 error. HC's stays float32: ``A_r = I + s·tanh(·)`` scales the whole stream, and a bf16
    projection put its rounding on all of it (over 150 draws at these weights, median 1.45 and largest 2.9 times
    PreLN's error, against 1.17 and 1.5 in float32). Either way the logits stay within twice PreLN's bf16 error
    against float64, same decoder."""
    ref = _model(spec, n_blocks=4)
    _randomize_connections(ref, spec)
    preln = _same_decoder("preln", ref)
    idx = torch.randint(0, ref.cfg.vocab_size, (2, T))
    products = MatrixProducts()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with products:
            got = copy.deepcopy(ref).float()(idx)
        preln_got = copy.deepcopy(preln).float()(idx)
    with torch.no_grad():
        want, preln_want = ref(idx), preln(idx)
    sublayers = 2 * ref.cfg.n_blocks
    assert products.seen["2d"].count(projection) >= sublayers
    assert set(products.seen["2d"]) == {torch.bfloat16, projection}
    assert products.seen["batched"] and set(products.seen["batched"]) == {torch.float32}  # the streams' products
    assert 0 < _rel(got, want) <= 2 * _rel(preln_got, preln_want)
