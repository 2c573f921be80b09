"""Building a model from configs: the one place where the decoder meets a named variant.

Under one seed every variant starts from the same decoder weights: the embedding, every attention and every MLP
are drawn from the caller's random stream exactly as PreLN's are, and whatever a mixer draws for its own weights
comes from a separate stream derived from the caller's state. That is what makes seed ``s`` of two variants a
pair (``harness.reporting.stats``). The parameter-matched baseline ``preln(match=...)`` starts from PreLN's
weights too, with its extra MLP units appended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib

import torch

import variants
from harness.config import ModelConfig
from harness.errors import UsageError
from harness.model.decoder import Decoder, preln_params


def build_model(model: ModelConfig, variant: str = "preln") -> Decoder:
    """A decoder of the given size whose depth mixing is the named variant.

    A mixer that asks to match another variant's parameter count (``preln(match=...)``) gets MLPs widened to
    ``matched_ffn_hidden``; the decoder itself only ever sees a size and a mixer.
    """
    mixer_seed, extra_units_seed = _derived_seed("mixer"), _derived_seed("extra MLP units")
    with _side_stream(mixer_seed):
        mixer = variants.build(variant, d_model=model.d_model, n_layers=model.n_layers)
    target = mixer.params_to_match()
    if not target:
        return Decoder(model, mixer)
    wide = dataclasses.replace(model, ffn_hidden=matched_ffn_hidden(model, target, mixer.extra_params()))
    base = Decoder(model, variants.build("preln", d_model=model.d_model, n_layers=model.n_layers))
    with _side_stream(extra_units_seed):
        decoder = Decoder(wide, mixer)
    _embed(base, decoder)
    return decoder


def _derived_seed(purpose: str) -> int:
    """A seed that is a function of the caller's random state and ``purpose``, read without drawing from it."""
    state = torch.random.get_rng_state().numpy().tobytes()
    return int.from_bytes(hashlib.sha256(state + purpose.encode()).digest()[:8], "little")


@contextlib.contextmanager
def _side_stream(seed: int):
    """Draws inside come from a generator seeded with ``seed``; the caller's generators are left as they were."""
    default = torch.get_default_device()
    cuda = []
    if default.type == "cuda":  # weights made directly on the card draw from its generator
        cuda = [default.index if default.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


@torch.no_grad()
def _embed(base: Decoder, wide: Decoder) -> None:
    """Copy ``base``'s weights into the leading block of each of ``wide``'s: a wider MLP keeps PreLN's first
    ``ffn_hidden`` units (a narrower one its first units of PreLN's), and everything else is PreLN's exactly."""
    if any(p.is_meta for p in wide.parameters()):
        return  # shapes only
    narrow = dict(base.named_parameters())
    for name, p in wide.named_parameters():
        if name in narrow:
            q = narrow[name]
            block = tuple(slice(0, min(m, n)) for m, n in zip(p.shape, q.shape))
            p[block].copy_(q[block])


def matched_ffn_hidden(model: ModelConfig, target: str, extra_params: int = 0) -> int:
    """The MLP width at which this size's decoder, with a mixer of ``extra_params`` parameters, has as many
    parameters as the decoder with the variant ``target``: one more hidden unit adds ``3 d`` per block (gate,
    up and down projections), so the nearest width is off by at most ``1.5 d`` per block."""
    with torch.device("meta"):  # shapes only
        wanted = build_model(model, target).num_params()
    per_unit = 3 * model.d_model * model.n_blocks
    width = model.ffn_hidden + round((wanted - preln_params(model) - extra_params) / per_unit)
    if width < 1:
        raise UsageError(
            f"No MLP width makes the model match the parameters of {target!r}: it has fewer "
            f"parameters than this model's attention, embedding and mixer alone."
        )
    return width
