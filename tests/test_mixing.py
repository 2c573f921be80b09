"""Every variant's depth-mixing matrix (spec §7) reproduces the inputs its layers and head actually received.

For reader ``l`` and channel group ``g``, ``Σ_i c[l, i, g] · src_i[g]`` (``src_0`` the embedding, ``src_{i+1}``
the output ``v_i``) must equal the recorded input to float64 precision. All mixer parameters are perturbed
first, so the weights are far from any trivial initialization.
"""

from __future__ import annotations

import pytest
import torch

import variants
from harness import build_model, model_preset
from harness.model.decoder import Trace

T = 16


def _traced_perturbed(spec: str):
    model = build_model(model_preset("tiny"), spec).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, model.cfg.vocab_size, (2, T))
    trace = Trace()
    with torch.no_grad():
        model(idx, trace=trace)
        c = model.mixer.mixing_matrix(trace)
    return model, trace, c


@pytest.mark.parametrize("spec", variants.names())
def test_mixing_matrix_rebuilds_every_layer_input(spec, rng_seed):
    model, trace, c = _traced_perturbed(spec)
    L, d = model.n_layers, model.cfg.d_model
    b, t = trace.embed.shape[:2]
    G = c.shape[-1]
    assert c.shape == (b, t, L + 1, L + 1, G) and d % G == 0
    assert c.dtype == torch.float64
    sources = torch.stack([trace.embed] + trace.outputs, dim=2)  # (b, t, L+1, d)
    sources = sources.view(b, t, L + 1, G, d // G)  # (b, t, sources, groups, d/G)
    rebuilt = torch.einsum("btrsg,btsgc->btrgc", c, sources).reshape(b, t, L + 1, d)  # (b, t, readers, d)
    actual = torch.stack(trace.inputs + [trace.head_input], dim=2)  # (b, t, readers, d)
    for reader in range(L + 1):
        err = (rebuilt[:, :, reader] - actual[:, :, reader]).norm() / actual[:, :, reader].norm()
        assert err < 1e-10, f"reader {reader}: relative error {float(err):.2e}"


@pytest.mark.parametrize("spec", variants.names())
def test_mixing_matrix_is_causal_in_depth(spec, rng_seed):
    """A reader never holds an output that does not exist yet: layer l sees v_0 .. v_{l-1} only."""
    model, _, c = _traced_perturbed(spec)
    L = model.n_layers
    future = torch.ones(L + 1, L + 1, dtype=torch.bool).triu(1)  # source i + 1 > reader l
    assert not c[:, :, future].any()


def test_preln_mixing_matrix_is_all_ones_lower_triangular(rng_seed):
    _, _, c = _traced_perturbed("preln")
    L1 = c.shape[2]
    expected = torch.ones(L1, L1, dtype=c.dtype).tril()
    assert torch.equal(c[..., 0], expected.expand_as(c[..., 0]))


# Reconstruction pins the weights only where a group's sources are linearly independent: value width d/G (and,
# for the memories, key width d_k) at least the number of sources. The tiny preset has 5 sources (the embedding
# and 4 outputs), so LDM runs here with groups of 16 or 64 channels and keys of 8.
PINNED_SPECS = [n for n in variants.names() if not n.startswith("ldm")] + [
    "ldm(groups=4,key_dim=8)",
    "ldm(groups=1,key_dim=8)",
    "ldm(read=memory,groups=4,key_dim=8)",
    "ldm(residual_write=off,groups=4,key_dim=8)",
    "ldm(qk_source=read,groups=4,key_dim=5)",
    "ldm-rls(groups=4,key_dim=8)",
    "ldm-rls(groups=1,key_dim=8,lambda=0.9)",
    "ldm-rls(read=memory,groups=4,key_dim=8,alpha=0.5)",
    "ldm-rls(residual_write=off,groups=4,key_dim=8)",
    "ldm-rls(qk_source=read,groups=4,key_dim=6,omega=off)",
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", PINNED_SPECS)
def test_reconstruction_pins_the_weights(spec, rng_seed):
    """Where every group has at least as many channels as there are sources, the layer inputs determine ``c``
    uniquely: solving for it from the recorded sources and inputs gives back the mixing matrix."""
    model, trace, c = _traced_perturbed(spec)
    L, d = model.n_layers, model.cfg.d_model
    b, t = trace.embed.shape[:2]
    G = c.shape[-1]
    assert d // G >= L + 1 and getattr(model.mixer, "dk", L + 1) >= L + 1, spec
    sources = torch.stack([trace.embed] + trace.outputs, dim=-1).view(b, t, G, d // G, L + 1)  # (b, t, g, c, s)
    inputs = torch.stack(trace.inputs + [trace.head_input], dim=-1).view(b, t, G, d // G, L + 1)  # (b, t, g, c, r)
    # Each column scaled to unit norm, so the smallest singular value measures independence, not magnitude.
    scale = sources.norm(dim=-2, keepdim=True)
    assert torch.linalg.svdvals(sources / scale).amin() > 1e-4  # the sources are independent: c is unique
    solved = torch.linalg.lstsq(sources / scale, inputs).solution / scale.transpose(-1, -2)  # (b, t, g, s, r)
    expected = c.permute(0, 1, 4, 3, 2)  # (b, t, g, s, r)
    torch.testing.assert_close(solved, expected, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize(
    "spec", ["ldm(residual_write=off,groups=4,key_dim=8)", "ldm-rls(residual_write=off,groups=4,key_dim=8)"]
)
def test_without_the_residual_write_outputs_are_read_through_the_memory_alone(spec, rng_seed):
    """The outputs reach later layers only through memory reads, whose weights change sign from token to token: the
    token-averaged matrix can show them near zero, the averaged magnitude (``matrix_abs``) does not."""
    from harness.model.diagnostics import mixing_summary

    model, _, c = _traced_perturbed(spec)
    L = model.n_layers
    # Recomputed by hand: the embedding's weight is one (x stays the embedding), each output's weight is its read's.
    assert torch.equal(c[..., :, 0, :], torch.ones_like(c[..., :, 0, :]))
    outputs = c[..., 1:, 1:, :]  # readers 1..L, sources v_0..v_{L-1}
    below = torch.ones(L, L, dtype=torch.bool).tril()
    assert (outputs[..., below, :].abs() > 0).all() and (outputs[..., ~below, :] == 0).all()
    summary = mixing_summary(model, torch.randint(0, model.cfg.vocab_size, (2, T)))
    magnitude = torch.tensor(summary["matrix_abs"], dtype=torch.float64)
    mean = torch.tensor(summary["matrix"], dtype=torch.float64)
    assert (magnitude[1:, 1:][below] > 0.01).all()
    assert (magnitude >= mean.abs() - 1e-12).all()  # |mean| never exceeds the mean magnitude
