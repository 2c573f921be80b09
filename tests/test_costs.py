"""The cost model against independent counts: parameters by hand and from a built model, FLOPs from torch's
own FLOP counter."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import variants
from harness import UsageError, build_model, model_preset
from harness.cli import main
from harness.model.costs import COLUMNS, cost_table, preln_flops_per_token, preln_params


@pytest.fixture(scope="module")
def small():
    return cost_table("small").set_index("variant")


def test_table_has_every_variant_and_preln_adds_nothing(small):
    assert list(small.index) == [variants.canonical(n) for n in variants.names()]
    assert list(small.reset_index().columns) == COLUMNS
    assert small.loc["preln", "params_added"] == 0
    assert small.loc["preln", "extra_flops_per_token"] == 0
    assert small.loc["preln", "stream_floats_per_token"] == 256


def test_hand_counts_at_the_small_preset(small):
    d, L, n = 256, 12, 4
    hc = L * (n + n * n + n) + L * (d * (n + 2) + 2)  # static A_m, A_r, B; dynamic W (d × (n + 2)), 2 scales
    mhc = L * (n * d * (n * n + 2 * n) + (n * n + 2 * n) + 3)  # phi, biases, three gates per layer
    N = L // 2  # DenseFormer: one DWA after each block, over 2, 3, ..., N + 1 stream states
    assert small.loc["hc", "params_added"] == hc
    assert small.loc["mhc", "params_added"] == mhc
    assert small.loc["denseformer", "params_added"] == N * (N + 3) // 2
    assert small.loc["attnres", "params_added"] == L * d  # pseudo-queries of layers 1 .. L-1 and the head
    assert small.loc["hc", "stream_floats_per_token"] == n * d
    assert small.loc["attnres", "stream_floats_per_token"] == (L + 1) * d
    assert small.loc["denseformer", "extra_flops_per_token"] == sum(2 * d * (i + 1) for i in range(1, N + 1))


@pytest.mark.parametrize("spec", ["hc(expansion=2,dynamic=off)", "attnres-block(block_size=3)", "mhc(expansion=2)"])
def test_params_added_match_a_built_model(spec):
    cfg = model_preset("tiny")
    table = cost_table("tiny", [spec])
    built = build_model(cfg, spec).num_params() - build_model(cfg, "preln").num_params()
    assert table.loc[0, "params_added"] == built
    assert table.loc[0, "variant"] == variants.canonical(spec)


@pytest.mark.parametrize("tie", [True, False])
def test_preln_counts_match_the_model_and_torch_flop_counter(tie, rng_seed):
    cfg = model_preset("tiny", tie_embeddings=tie)
    model = build_model(cfg, "preln")
    assert preln_params(cfg) == model.num_params()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    # The math kernel runs attention as plain matrix products, which the counter sees.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx)
    assert preln_flops_per_token(cfg) == counter.get_total_flops() / idx.numel()


def test_relative_columns_divide_by_preln_totals():
    table = cost_table("tiny")
    cfg = model_preset("tiny")
    assert table.attrs["preln_params"] == preln_params(cfg)
    assert (table.params_added_frac * preln_params(cfg) - table.params_added).abs().max() < 1e-6
    assert (table.extra_flops_frac * preln_flops_per_token(cfg) - table.extra_flops_per_token).abs().max() < 1e-6


def test_unknown_preset_is_a_usage_error():
    with pytest.raises(UsageError, match="Known presets"):
        cost_table("huge")


def test_cli_prints_the_table_with_units_and_percentages(capsys):
    from harness import units

    assert main(["variants", "--costs", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    table = cost_table("tiny")
    lines = out.split("\n\n")[0].splitlines()  # the roofline table follows (tests/test_roofline.py)
    assert lines[0].startswith("cost over PreLN at the tiny preset (PreLN: ") and "params added" in lines[1]
    for row, line in zip(table.itertuples(), lines[2:], strict=True):
        assert line.split()[:5] == [
            row.variant,
            units.si(row.params_added),
            f"+{units.percent(row.params_added_frac)}",
            f"{row.stream_floats_per_token:,}",
            "floats",
        ]
        sizes = " ".join(f"{k} {v}," for k, v in row.sizes.items()).rstrip(",").split()
        assert line.split()[5:] == [
            units.si(row.extra_flops_per_token),
            f"+{units.percent(row.extra_flops_frac)}",
            *sizes,
        ]
        assert f"{row.params_added_frac:.6f}" not in line  # no bare fractions
    assert main(["variants", "--costs", "--preset", "tiny", "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)["costs"]
    assert raw[1]["params_added"] == int(table.params_added[1])  # the machine-readable form keeps raw numbers


@pytest.mark.parametrize(
    "n, shown", [(0, "0"), (27, "27"), (3072, "3.07k"), (800256, "800k"), (1_695_360, "1.7M"), (2.5e9, "2.5G")]
)
def test_counts_read_with_si_prefixes(n, shown):
    from harness import units

    assert units.si(n) == shown


@pytest.mark.parametrize(
    "fraction, shown", [(0.044506, "4.45%"), (0.000171, "0.0171%"), (2e-7, "0.000020%"), (3.1e-5, "0.0031%"), (0, "0%")]
)
def test_shares_read_as_percentages(fraction, shown):
    from harness import units

    assert units.percent(fraction) == shown


# -- LDM and LDM-RLS: the count follows the implementation that runs -----------------------------------------------
LDM_COST_SPECS = [
    "ldm",
    "ldm(groups=1)",
    "ldm(groups=4,key_dim=6)",
    "ldm(read=memory,groups=2)",
    "ldm(residual_write=off)",
    "ldm(qk_source=read,groups=8)",
    "ldm-rls",
    "ldm-rls(groups=1)",
    "ldm-rls(groups=4,key_dim=6,omega=off)",
    "ldm-rls(read=memory,groups=2)",
    "ldm-rls(residual_write=off,groups=8,key_dim=12)",
]


def _mixer_matmul_flops_per_token(mixer, b: int = 2, t: int = 3) -> float:
    """Matrix-product FLOPs per token of one forward through ``mixer`` alone, by torch's FLOP counter."""
    e = torch.randn(b, t, mixer.d_model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        state = mixer.init_state(e)
        for layer in range(mixer.n_layers):
            mixer.read(state, layer)
            state = mixer.write(state, layer, torch.randn_like(e))
        mixer.read_head(state)
    return counter.get_total_flops() / (b * t)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["dual", "recurrent"])
@pytest.mark.parametrize("spec", LDM_COST_SPECS)
def test_ldm_matmul_count_matches_torch_flop_counter(spec, impl, rng_seed):
    from variants.ops import ldm_costs

    mixer = variants.build(spec, d_model=48, n_layers=5)
    mixer.impl = impl
    mm, other = ldm_costs.flops_per_token(mixer)
    assert mm == _mixer_matmul_flops_per_token(mixer)
    assert other > 0 and mixer.extra_flops_per_token() == mm + other


@pytest.mark.parametrize("name", ["ldm", "ldm-rls"])
def test_one_group_is_priced_as_the_dual_form_that_runs(name):
    """At groups=1 (d_k = d) the recurrent form would spend 2·d² per read; the dual form that runs spends O(L·d)."""
    table = cost_table("small", [f"{name}(groups=1)"]).set_index("variant")
    with torch.device("meta"):
        mixer = variants.build(f"{name}(groups=1)", d_model=256, n_layers=12)
    assert mixer.impl == "dual"
    dual = mixer.extra_flops_per_token()
    mixer.impl = "recurrent"
    recurrent = mixer.extra_flops_per_token()
    assert table.loc[f"{name}(groups=1)", "extra_flops_per_token"] == dual
    assert dual < recurrent / 2


@pytest.mark.parametrize("target", ["ldm-rls", "mhc"])
def test_parameter_matched_preln_counts_its_wider_mlps(target, rng_seed):
    cfg = model_preset("tiny")
    row = cost_table("tiny", [f"preln(match={target})"]).iloc[0]
    model = build_model(cfg, f"preln(match={target})")
    assert row["params_added"] == model.num_params() - preln_params(cfg) > 0
    assert row["stream_floats_per_token"] == cfg.d_model
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx)
    assert row["extra_flops_per_token"] == counter.get_total_flops() / idx.numel() - preln_flops_per_token(cfg)


@pytest.mark.parametrize(
    "preset, nominal", [("gpt2-small", 124e6), ("gpt2-medium", 350e6), ("gpt2-large", 774e6), ("1.3b", 1.3e9)]
)
def test_the_preset_ladder_has_its_nominal_sizes(preset, nominal):
    """Each rung's PreLN, built on the meta device (shapes, no storage), within 3% of the size it is named for."""
    cfg = model_preset(preset)
    with torch.device("meta"):
        model = build_model(cfg, "preln")
    assert model.num_params() == preln_params(cfg)
    assert abs(model.num_params() / nominal - 1) < 0.03, model.num_params()
    assert cfg.d_model // cfg.n_heads in (64, 128) and cfg.ffn_hidden % 128 == 0


def test_the_cost_table_states_each_mixers_sizes_at_the_preset():
    table = cost_table("1.3b").set_index("variant")
    assert table.loc["ldm-rls", "sizes"] == {"groups": 16, "key width": 128, "value width": 128}
    assert table.loc["mhc", "sizes"] == {"streams": 4}
    assert table.loc["attnres-block", "sizes"] == {"block size": 4, "blocks": 12}
    assert table.loc["preln", "sizes"] == {}
