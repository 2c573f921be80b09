"""Building a model from configs: the one place where the decoder meets a named variant."""

from __future__ import annotations

import variants
from harness.config import ModelConfig
from harness.model import Decoder


def build_model(model: ModelConfig, variant: str = "preln") -> Decoder:
    """A decoder of the given size whose depth mixing is the named variant."""
    mixer = variants.build(variant, d_model=model.d_model, n_layers=model.n_layers)
    return Decoder(model, mixer)
