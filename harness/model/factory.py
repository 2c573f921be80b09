"""Building a model from configs: the one place where the decoder meets a named variant."""

from __future__ import annotations

import dataclasses

import torch

import variants
from harness.config import ModelConfig
from harness.errors import UsageError
from harness.model.decoder import Decoder


def build_model(model: ModelConfig, variant: str = "preln") -> Decoder:
    """A decoder of the given size whose depth mixing is the named variant.

    A mixer that asks to match another variant's parameter count (``preln(match=...)``) gets MLPs widened to
    ``matched_ffn_hidden``; the decoder itself only ever sees a size and a mixer.
    """
    mixer = variants.build(variant, d_model=model.d_model, n_layers=model.n_layers)
    target = mixer.params_to_match()
    if target:
        model = dataclasses.replace(model, ffn_hidden=matched_ffn_hidden(model, target, mixer.extra_params()))
    return Decoder(model, mixer)


def matched_ffn_hidden(model: ModelConfig, target: str, extra_params: int = 0) -> int:
    """The MLP width at which this size's decoder, with a mixer of ``extra_params`` parameters, has as many
    parameters as the decoder with the variant ``target``: one more hidden unit adds ``3 d`` per block (gate,
    up and down projections), so the nearest width is off by at most ``1.5 d`` per block."""
    # Imported here: costs imports this module at its top (a cycle) and loads pandas.
    from harness.model.costs import preln_params

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
