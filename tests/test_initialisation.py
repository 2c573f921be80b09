"""Under one seed every variant starts from PreLN's decoder weights, bit for bit, and leaves the caller's random
stream where PreLN leaves it: what makes seed ``s`` of two variants a pair in the report's statistics."""

from __future__ import annotations

import pytest
import torch

import variants
from harness import build_model, model_preset

CFG = model_preset("tiny", n_blocks=3)
MATCHED = [f"preln(match={name})" for name in variants.names() if name != "preln"]


def _build(spec: str, seed: int):
    torch.manual_seed(seed)
    model = build_model(CFG, spec)
    return model, torch.random.get_rng_state()


def _decoder(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("mixer.")}


@pytest.mark.parametrize("spec", variants.names())
def test_every_variant_starts_from_prelns_decoder_weights(spec, rng_seed):
    reference, after_reference = _build("preln", rng_seed)
    model, after = _build(spec, rng_seed)
    ref, got = _decoder(reference), _decoder(model)
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    # Data order and anything else drawn after the model follows the same stream too.
    assert torch.equal(after, after_reference)


@pytest.mark.parametrize("spec", MATCHED)
def test_matched_preln_is_preln_with_mlp_units_appended(spec, rng_seed):
    reference, after_reference = _build("preln", rng_seed)
    model, after = _build(spec, rng_seed)
    ref, got = _decoder(reference), _decoder(model)
    assert got.keys() == ref.keys()
    widened = 0
    for name in ref:
        if got[name].shape == ref[name].shape:
            assert torch.equal(got[name], ref[name]), name
            continue
        assert any(k in name for k in ("gate_proj", "up_proj", "down_proj")), name
        block = tuple(slice(0, min(m, n)) for m, n in zip(got[name].shape, ref[name].shape))
        assert torch.equal(got[name][block], ref[name][block]), name
        widened += 1
    if model.cfg.ffn_hidden != CFG.ffn_hidden:
        assert widened == 3 * CFG.n_blocks
        # The extra units are initialised like the rest, not left at zero or copied.
        extra = got["layers.1.fn.up_proj.weight"][CFG.ffn_hidden :]
        if extra.numel() > 1:
            assert extra.std() == pytest.approx(CFG.init_std, rel=0.5)
            assert not torch.equal(extra[0], ref["layers.1.fn.up_proj.weight"][0])
    assert torch.equal(after, after_reference)


@pytest.mark.parametrize("spec", ["ldm-rls", "mhc"])
def test_mixer_weights_still_follow_the_seed(spec, rng_seed):
    """The mixer's own stream is derived from the seed: the same seed repeats it, another seed changes it."""
    mixer = {k: v for k, v in _build(spec, rng_seed)[0].state_dict().items() if k.startswith("mixer.")}
    again = {k: v for k, v in _build(spec, rng_seed)[0].state_dict().items() if k.startswith("mixer.")}
    other = {k: v for k, v in _build(spec, rng_seed + 1)[0].state_dict().items() if k.startswith("mixer.")}
    assert mixer and all(torch.equal(mixer[k], again[k]) for k in mixer)
    assert any(not torch.equal(mixer[k], other[k]) for k in mixer)


def test_shapes_only_builds_draw_nothing(rng_seed):
    before = torch.random.get_rng_state()
    with torch.device("meta"):
        build_model(CFG, "preln(match=ldm-rls)")
    assert torch.equal(before, torch.random.get_rng_state())
