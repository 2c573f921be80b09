"""Every registered variant on the tiny preset (d=64, 4 layers, T=16, float64): shapes, causality, gradients,
the mixing matrix, the LDM knob grid, and one-sentence errors for bad names and values.

Parametrized over ``variants.names()``, so a newly registered variant is covered without editing this file.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

import variants
from harness import build_model, model_preset
from harness.cli import main
from harness.errors import UsageError
from harness.model.decoder import Trace

T, VOCAB = 16, 512


def _model(spec: str):
    return build_model(model_preset("tiny"), spec).to(torch.float64)


@pytest.fixture(scope="module", params=variants.names())
def name(request) -> str:
    return request.param


def test_shapes_are_preserved(name, rng_seed):
    model = _model(name)
    idx = torch.randint(0, VOCAB, (3, T))
    trace = Trace()
    with torch.no_grad():
        logits = model(idx, trace=trace)
    assert logits.shape == (3, T, VOCAB) and torch.isfinite(logits).all()
    assert len(trace.inputs) == len(trace.outputs) == model.n_layers
    assert all(a.shape == (3, T, 64) for a in [*trace.inputs, *trace.outputs, trace.head_input])


def test_causal(name, rng_seed):
    model = _model(name).eval()
    idx = torch.randint(0, VOCAB, (2, T))
    t = int(torch.randint(0, T - 1, ()))
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, VOCAB, (2, T - t - 1))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the change is visible after t


def test_every_parameter_gets_a_gradient(name, rng_seed):
    model = _model(name)
    idx = torch.randint(0, VOCAB, (2, T))
    F.cross_entropy(model(idx).flatten(0, 1), torch.randint(0, VOCAB, (2 * T,))).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no (finite) gradient for {missing}"


def test_trains_with_bfloat16_weights(name, rng_seed):
    """Lightning's bf16-true casts the weights themselves: the mixers keep their state in float32, so the decoder
    must hand each layer its input in the layers' precision."""
    model = build_model(model_preset("tiny"), name).to(torch.bfloat16)
    idx = torch.randint(0, VOCAB, (2, T))
    logits = model(idx)
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float().flatten(0, 1), torch.randint(0, VOCAB, (2 * T,))).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no (finite) gradient for {missing}"


def test_mixing_matrix_reproduces_layer_inputs(name, rng_seed):
    """Each layer's input (and the head's) is Σ_i c[l, i, g]·source_i per channel group (spec §7)."""
    model = _model(name)
    trace = Trace()
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, T)), trace=trace)
    L = model.n_layers
    c = model.mixer.mixing_matrix(trace)
    G = c.shape[-1]
    assert c.shape == (2, T, L + 1, L + 1, G) and 64 % G == 0
    src = torch.stack([trace.embed] + trace.outputs, 2).unflatten(-1, (G, 64 // G))  # (b, t, s, g, v)
    for reader, target in enumerate(trace.inputs + [trace.head_input]):
        rebuilt = torch.einsum("btsg,btsgv->btgv", c[:, :, reader], src).flatten(-2)
        torch.testing.assert_close(rebuilt, target, rtol=1e-9, atol=1e-9, msg=f"reader {reader}")


def test_costs_are_reported(name):
    mixer = variants.build(name, d_model=64, n_layers=4)
    assert isinstance(mixer.stream_floats_per_token(), int) and mixer.stream_floats_per_token() >= 64
    assert isinstance(mixer.extra_flops_per_token(), int) and mixer.extra_flops_per_token() >= 0
    assert mixer.extra_params() >= 0


# -- the LDM knob grid: every valid combination builds and trains ------------------------------------------------
def _ldm_grid() -> list[str]:
    specs = [f"ldm(write={write},read=residual)" for write in ("outer", "rls")]  # PreLN: no memory knobs apply
    for write, read, rw, qk, groups in itertools.product(
        ("outer", "rls"), ("residual+memory", "memory"), ("on", "off"), ("residual", "read"), (1, 4)
    ):
        base = f"ldm(write={write},read={read},residual_write={rw},qk_source={qk},groups={groups},key_dim=8"
        if write == "outer":  # λ and ω are RLS knobs: with write=outer they are errors by design
            specs.append(base + ")")
            continue
        for lam, omega in itertools.product(("learned", "0.9"), ("on", "off")):
            specs.append(base + f",lambda={lam},omega={omega})")
    return specs


@pytest.mark.slow
@pytest.mark.parametrize("spec", _ldm_grid())
def test_ldm_knob_grid_builds_and_runs(spec, rng_seed):
    model = _model(spec)
    idx = torch.randint(0, VOCAB, (2, T))
    logits = model(idx)
    assert logits.shape == (2, T, VOCAB)
    loss = F.cross_entropy(logits.flatten(0, 1), torch.randint(0, VOCAB, (2 * T,)))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# -- bad names and values: one sentence naming the allowed values --------------------------------------------
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("ldm-rsl", ["'ldm-rls'", "preln"]),  # unknown variant: closest name, then the list
        ("ldm(group=4)", ["'groups'", "key_dim"]),  # unknown knob
        ("ldm(groups=four)", ["groups", "divisor"]),  # wrong type
        ("ldm-rls(alpha=big)", ["alpha", "> 0"]),
        ("ldm(write=sum)", ["outer", "rls"]),
        ("ldm(read=both)", ["residual+memory", "memory", "residual"]),
        ("ldm(residual_write=maybe)", ["on", "off"]),
        ("ldm(groups=3)", ["groups=3", "1, 2, 4, 8, 16, 32, 64"]),  # does not divide d = 64
        ("ldm(groups=0)", ["groups", "positive"]),
        ("ldm(key_dim=-1)", ["key_dim", "positive integer", "0 for d_model / groups"]),
        ("ldm-rls(lambda=0)", ["lambda", "learned", "(0, 1]"]),
        ("ldm-rls(lambda=1.5)", ["lambda", "learned", "(0, 1]"]),
        ("ldm-rls(lambda=fast)", ["lambda", "learned", "(0, 1]"]),
        ("ldm-rls(alpha=0)", ["alpha", "> 0"]),
        ("ldm-rls(alpha=-2)", ["alpha", "> 0"]),
        ("ldm(lambda=0.9)", ["lambda", "write=rls"]),  # an RLS knob with write=outer
        ("ldm(omega=off)", ["omega", "write=rls"]),
        ("ldm(alpha=2)", ["alpha", "write=rls"]),
        ("ldm(qk_source=keys)", ["qk_source", "residual, read", "'keys'"]),
        # degenerate combinations: a model that ignores its layers, or memory knobs on a model without a memory
        (
            "ldm(read=residual,residual_write=off)",
            ["ignores every layer", "residual_write=on", "read=residual+memory", "read=memory"],
        ),
        ("ldm-rls(read=residual,residual_write=off,groups=4)", ["ignores every layer"]),
        (
            "ldm-rls(read=residual,groups=4)",
            ["read=residual", "groups=4 changes nothing", "groups at 16", "read=residual+memory"],
        ),
        ("ldm(read=residual,qk_source=read)", ["qk_source=read changes nothing", "qk_source at residual"]),
        ("ldm(read=residual,key_dim=8)", ["key_dim=8", "key_dim at 0"]),
        ("ldm-rls(read=residual,lambda=0.9)", ["lambda=0.9", "lambda at learned"]),
        ("ldm-rls(read=residual,omega=off)", ["omega=off", "omega at on"]),
        # a key width of one: a sign, not a direction
        ("ldm(key_dim=1)", ["key_dim=1", "only a sign", "key_dim=0", "≥ 2"]),
        ("ldm-rls(groups=64)", ["groups=64", "width 1", "1, 2, 4, 8, 16, 32", "key_dim ≥ 2"]),
        ("ldm-rls(groups=64,omega=off)", ["groups=64", "only a sign"]),
    ],
)
def test_bad_names_and_values_raise_one_sentence(spec, expected):
    with pytest.raises(UsageError) as info:
        variants.build(spec, d_model=64, n_layers=4)
    message = str(info.value)
    assert "\n" not in message and message.count(". ") <= 1, message  # one sentence (plus a "Did you mean" hint)
    for word in expected:
        assert word in message, message
    with pytest.raises(UsageError):  # the run config's validation path says the same
        variants.validate(spec, d_model=64, n_layers=4)


def test_defaults_and_names_round_trip():
    assert variants.canonical("ldm(write=rls)") == "ldm(write=rls)"
    assert variants.canonical("ldm-rls(groups=16,lambda=learned,omega=on)") == "ldm-rls"
    assert variants.canonical("ldm-rls(lambda=1)") == "ldm-rls(lambda=1.0)"
    assert variants.build("ldm-rls(key_dim=0)", d_model=64, n_layers=4).dk == 64 // 16


def test_qk_source_defaults_to_the_read_without_residual_write():
    """With residual_write=off the residual stays the embedding, so the ablation addresses the memory from the reads
    unless asked otherwise; the canonical name then writes qk_source out, so run ids and tables show what ran."""
    build = variants.build
    assert build("ldm", d_model=64, n_layers=4).cfg.qk_source == "residual"
    assert build("ldm-rls(residual_write=off)", d_model=64, n_layers=4).cfg.qk_source == "read"
    assert build("ldm(residual_write=off,qk_source=residual)", d_model=64, n_layers=4).cfg.qk_source == "residual"
    for spec in ("ldm(residual_write=off)", "ldm(qk_source=read,residual_write=off)"):
        assert variants.canonical(spec) == "ldm(residual_write=off,qk_source=read)"
    assert variants.canonical("ldm(qk_source=residual)") == "ldm"
    assert variants.canonical("ldm(qk_source=read)") == "ldm(qk_source=read)"
    name = variants.canonical("ldm-rls(qk_source=residual,residual_write=off,groups=4)")
    assert name == "ldm-rls(residual_write=off,qk_source=residual,groups=4)"
    assert variants.canonical(name) == name


def test_groups_at_fixed_key_width():
    """key_dim fixes d_k while groups vary: the memory M holds d·d_k floats per token whatever G is, only P grows."""
    for groups in (1, 4, 16, 64):
        mixer = variants.build(f"ldm-rls(groups={groups},key_dim=8)", d_model=64, n_layers=4)
        assert (mixer.G, mixer.dk, mixer.dv) == (groups, 8, 64 // groups)
        assert mixer.stream_floats_per_token() == 64 + 64 * 8 + groups * 8 * 8
        assert mixer.keys[0].fc2.out_features == groups * 8 + groups  # keys and ω


def test_listing_names_every_ldm_knob_with_allowed_values_and_default(capsys):
    assert main(["variants", "--json"]) == 0
    knobs = {v["name"]: {k["knob"]: k for k in v["knobs"]} for v in json.loads(capsys.readouterr().out)}
    for name in ("ldm", "ldm-rls"):
        qk = knobs[name]["qk_source"]
        assert qk["allowed"] == "residual, read" and qk["default"] == "residual" and "residual_write=off" in qk["help"]
        assert knobs[name]["key_dim"]["default"] == "0" and "d_model / groups" in knobs[name]["key_dim"]["allowed"]
    assert main(["variants"]) == 0
    assert "qk_source" in capsys.readouterr().out


def test_canonical_names_write_out_a_default_that_follows_another_knob():
    """The registry's rule on its own: a knob is left out of the name only where leaving it out gives the same
    config and its value is the listed default."""
    from dataclasses import dataclass

    from variants.registry import Registry, knob

    registry = Registry("toy")

    @registry.register("toy")
    class Toy:
        @dataclass(frozen=True)
        class Config:
            mode: bool = knob(True, "a switch", choices=("on", "off"))
            follow: str | None = knob(None, "b when mode is on, c when it is off", choices=("b", "c"))

            def __post_init__(self):
                if self.follow is None:
                    object.__setattr__(self, "follow", "b" if self.mode else "c")

    assert registry.canonical("toy") == registry.canonical("toy(follow=b)") == "toy"
    assert registry.canonical("toy(follow=c)") == "toy(follow=c)"
    for spec in ("toy(mode=off)", "toy(mode=off,follow=c)"):
        assert registry.canonical(spec) == "toy(mode=off,follow=c)"
    assert registry.canonical("toy(mode=off,follow=b)") == "toy(mode=off,follow=b)"
    assert registry.describe()[0]["knobs"][1]["default"] == "b"


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "small", "gpt2-small"])
@pytest.mark.parametrize("target", ["ldm-rls", "ldm-rls(groups=32,omega=off)", "mhc", "attnres", "denseformer"])
def test_parameter_matched_preln_is_within_half_a_percent(preset, target):
    size = model_preset(preset)
    with torch.device("meta"):  # counts only: the largest preset allocates nothing
        wanted = build_model(size, target).num_params()
        matched = build_model(size, f"preln(match={target})")
        plain = build_model(size, "preln")
    # The widened MLPs are all that changed: a PreLN with the same width built by hand has the same count.
    assert matched.num_params() == plain.num_params() + 3 * size.d_model * size.n_blocks * (
        matched.cfg.ffn_hidden - size.ffn_hidden
    )
    assert all(layer.fn.up_proj.out_features == matched.cfg.ffn_hidden for layer in matched.layers[1::2])
    assert abs(matched.num_params() - wanted) <= 0.005 * wanted
    assert matched.cfg.ffn_hidden >= size.ffn_hidden  # every target adds parameters (denseformer a handful)
    assert variants.canonical(f"preln(match={target})") == f"preln(match={variants.canonical(target)})"


def test_parameter_matched_preln_refuses_what_it_cannot_match():
    for spec, message in (
        ("preln(match=ldm-rsl)", "knob 'match'"),
        ("preln(match=preln(match=ldm))", "does not match another"),
        ("preln(match=ldm-rls(groups=7))", "must divide d_model"),
    ):
        with pytest.raises(UsageError, match=message) as info:
            variants.validate(spec, d_model=64, n_layers=4)
        assert "\n" not in str(info.value)


def test_config_parses_its_variant_once_into_a_typed_value(monkeypatch, rng_seed):
    """build_config reads the variant text once; building, hashing and naming the run take the parsed value."""
    import pickle

    from harness import build_config, rundir
    from variants.registry import Registry

    groups = [1, 2, 4, 8][rng_seed % 4]
    cfg = build_config({"variant": f"ldm-rls( lambda=0.99 , groups={groups})", "model": {"preset": "tiny"}})
    assert isinstance(cfg.variant, variants.VariantSpec)
    assert cfg.variant == f"ldm-rls(groups={groups},lambda=0.99)" and cfg.variant.name == "ldm-rls"
    assert (cfg.variant.config.groups, cfg.variant.config.lambda_) == (groups, 0.99)
    assert cfg.variant.knobs == {"groups": str(groups), "lambda": "0.99"}
    assert pickle.loads(pickle.dumps(cfg)).variant.config == cfg.variant.config
    assert type(cfg.to_dict()["variant"]) is str  # the saved config holds plain types only

    def parse_again(self, spec):
        raise AssertionError(f"the variant {spec!r} was parsed again")

    monkeypatch.setattr(Registry, "config", parse_again)
    monkeypatch.setattr(Registry, "canonical", parse_again)
    model = build_model(cfg.model, cfg.variant)
    assert model.mixer.cfg.groups == groups
    assert rundir.run_id(cfg).startswith(f"ldm-rls-groups-{groups}-lambda-0.99-s0-")
    rundir.config_hash(cfg)


def test_a_variant_too_narrow_for_the_model_is_refused_when_the_config_is_built():
    from harness import build_config

    with pytest.raises(UsageError, match=r"groups=64 at d_model=64 gives keys of width 1"):
        build_config({"variant": "ldm-rls(groups=64)", "model": {"preset": "tiny"}})
    build_config({"variant": "ldm-rls(groups=64)", "model": {"preset": "tiny", "d_model": 128, "n_heads": 2}})
