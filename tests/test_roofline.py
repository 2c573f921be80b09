"""The roofline (``harness.model.roofline``): its depth traffic against a count made read by read, layer by layer, its
floors against the max of compute and memory time, and the ordering of the floors that the formulas imply."""

from __future__ import annotations

import pytest
import torch

import variants
from harness.cli import main
from harness.config import model_preset
from harness.errors import UsageError
from harness.model.roofline import (
    CARDS,
    Costs,
    card_named,
    depth_floats,
    floor_column,
    resized,
    roofline_table,
    variant_costs,
)


def _mixer(spec: str, d: int, L: int):
    with torch.device("meta"):
        return variants.build(spec, d_model=d, n_layers=L)


def _ldm_by_events(d, L, G, dk, read_mode, residual_write, rls):
    """Walks the dual form: the embedding's write (read=memory), then each layer's read and write, then the head's
    read, keeping the writes so far; counts every vector moved."""
    resid = weighted = 0
    held, pair = 0, G * dk + d

    def read():
        nonlocal weighted
        if held:
            weighted += held * pair  # the sources
            weighted += d + (d if read_mode == "residual+memory" else 0)  # the output, and the x it adds

    def write():
        nonlocal weighted, held
        weighted += held * pair + pair if rls else G * dk  # RLS whitens against every earlier write
        held += 1

    if read_mode == "memory":
        write()
    for layer in range(L + 1):
        read()
        if layer < L:
            write()
            resid += 3 * d if residual_write else 0
    return resid, weighted


@pytest.mark.parametrize("L", [2, 6, 13])
@pytest.mark.parametrize(
    "spec",
    [
        "ldm",
        "ldm(groups=4,key_dim=8)",
        "ldm(read=memory)",
        "ldm(residual_write=off)",
        "ldm(read=residual)",
        "ldm-rls",
        "ldm-rls(groups=2)",
        "ldm-rls(read=memory)",
    ],
)
def test_ldm_traffic_matches_a_count_read_by_read(spec, L):
    d = 32
    mixer = _mixer(spec, d, L)
    cfg = mixer.cfg
    if cfg.read == "residual":  # no memory: PreLN's additions alone
        assert depth_floats("ldm", mixer) == (3 * d * L, 0)
        return
    expected = _ldm_by_events(d, L, mixer.G, mixer.dk, cfg.read, cfg.residual_write, cfg.write == "rls")
    assert depth_floats(variants.spec(spec).name, mixer) == expected


def test_ldm_closed_form_of_the_docstring():
    """Σ_r n_r (G d_k + d) over the readers, plus the reads' outputs, the stored keys and the residual additions."""
    d, L, G, dk = 64, 10, 8, 4
    mixer = _mixer(f"ldm(groups={G},key_dim={dk})", d, L)
    reads = (G * dk + d) * L * (L + 1) // 2 + L * 2 * d  # reader 0 holds no write and moves nothing
    assert depth_floats("ldm", mixer) == (3 * d * L, reads + L * G * dk)


def _attnres_block_by_events(d, L, S):
    resid = weighted = 0
    blocks, partial = 1, False  # the embedding is the first source
    for layer in range(L + 1):
        weighted += (blocks + partial) * d + d
        if layer < L:
            resid += 3 * d if partial else 2 * d
            partial = True
            if (layer + 1) % S == 0:
                blocks, partial = blocks + 1, False
    return resid, weighted


@pytest.mark.parametrize("L", [1, 2, 7, 24])
def test_the_other_mixers_match_a_count_read_by_read(L):
    d = 16
    sources, weighted = 1, 0  # AttnRes: the embedding, then every output
    for layer in range(L + 1):
        weighted += sources * d + d
        if layer < L:
            sources, weighted = sources + 1, weighted + d
    assert depth_floats("attnres", _mixer("attnres", d, L)) == (0, weighted)

    for S in (1, 3, 4):
        mixer = _mixer(f"attnres-block(block_size={S})", d, L)
        assert depth_floats("attnres-block", mixer) == _attnres_block_by_events(d, L, S)

    for name in ("hc", "mhc"):
        for n in (1, 4):
            per_layer = n * d + d + (n * d + d + n * d)  # read the stream into the input; stream + output into stream
            expected = L * per_layer + n * d + d  # the head
            assert depth_floats(name, _mixer(f"{name}(expansion={n})", d, L)) == (0, expected)

    stored, weighted = 1, 0  # DenseFormer: block outputs kept, the embedding first
    for layer in range(L):
        if layer % 2 == 1 or layer == L - 1:
            stored += 1
            weighted += stored * d + 2 * d
    assert depth_floats("denseformer", _mixer("denseformer", d, L)) == (3 * d * L, weighted)
    assert depth_floats("preln", _mixer("preln", d, L)) == (3 * d * L, 0)


def test_floor_is_the_trunk_at_peak_plus_the_slower_side_of_the_mixing(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    trunk, mix, resid, weighted = (int(v) for v in torch.randint(1, 10**7, (4,), generator=gen))
    c = Costs(trunk, mix, resid, weighted, 4)
    card = CARDS["H100 SXM"]
    peak, bw = 989e12, 3.35e12
    step_bytes = (2 * resid + 3 * weighted) * 4
    assert c.bytes(True) == step_bytes and c.bytes(False) == (resid + weighted) * 4
    assert c.flops(True) == 3 * (trunk + mix)
    assert c.floor_s(card) == pytest.approx(3 * trunk / peak + max(3 * mix / peak, step_bytes / bw), rel=1e-12)
    assert c.floor_s(card, backward=False) == pytest.approx(
        trunk / peak + max(mix / peak, (resid + weighted) * 4 / bw), rel=1e-12
    )


def test_floor_ratios_are_ordered_as_the_traffic_is():
    ratios = {}
    for depth in (24, 48):
        table = roofline_table(resized("gpt2-small", depth), seq_len=1024).set_index("variant")
        ratios[depth] = table
        for card in CARDS.values():
            col = table[floor_column(card)]
            assert col["preln"] == 1.0 and (col > 1.0).drop("preln").all()
            # The RLS write whitens against every earlier write: it moves about twice what LDM's reads do.
            assert col["ldm-rls"] > col["ldm"] > col["attnres-block"]
            # Full AttnRes reads every earlier output, a block AttnRes only the block sums.
            assert col["attnres"] > col["attnres-block"]
        # More bandwidth for the same peak lowers every mixer's floor relative to PreLN's.
        assert (table[floor_column(CARDS["H200"])] <= table[floor_column(CARDS["H100 SXM"])]).all()
        assert (table[floor_column(CARDS["A100 80GB"])] <= table[floor_column(CARDS["A100 40GB"])]).all()
    col = floor_column(CARDS["H100 SXM"])
    # Quadratic reads grow with depth faster than the linear traffic of the streams.
    growth = ratios[48][col] / ratios[24][col]
    assert growth["attnres"] > growth["hc"] and growth["ldm"] > growth["hc"]


def test_bf16_state_halves_the_bytes():
    model = model_preset("tiny")
    full, half = (variant_costs("ldm", model, dtype=dt) for dt in ("float32", "bf16"))
    assert full.bytes(True) == 2 * half.bytes(True) and full.flops(True) == half.flops(True)


@pytest.mark.parametrize(
    "device_name, card",
    [
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H200", "H200"),
        ("h100 sxm", "H100 SXM"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA L4", None),
    ],
)
def test_cards_are_found_by_their_device_names(device_name, card):
    found = card_named(device_name)
    assert (found.name if found else None) == card


def test_cli_prints_a_floor_column_per_card(capsys):
    assert main(["variants", "--costs", "--preset", "tiny", "--depth", "8"]) == 0
    out = capsys.readouterr().out
    roof = out.split("\n\n")[1].splitlines()
    assert roof[0].startswith("roofline at L = 8 sublayers, d = 64")
    assert all(card in roof[1] for card in CARDS)
    assert roof[2].split()[0] == "preln" and roof[2].split()[-4:] == ["1.00x"] * 4


@pytest.mark.parametrize("flag, value", [("--dtype", "fp8"), ("--depth", "7")])
def test_bad_roofline_settings_are_refused(flag, value, capsys):
    assert main(["variants", "--costs", "--preset", "tiny", flag, value]) == 2
    assert value in capsys.readouterr().err


def test_unknown_family_is_refused():
    with pytest.raises(UsageError, match="known"):
        depth_floats("mamba", _mixer("preln", 8, 2))
