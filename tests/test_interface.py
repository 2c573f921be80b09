"""The mixer interface: every registered variant implements it, and a class that does not cannot register."""

from dataclasses import dataclass

import pytest
import torch

import variants
from variants.base import DepthMixer
from variants.registry import Registry


def test_every_registered_variant_implements_the_whole_interface():
    assert variants.names()[0] == "preln"  # the baseline leads every listing and keeps its colour
    for name in variants.names():
        cls = variants.REGISTRY.entry(name).cls
        assert not getattr(cls, "__abstractmethods__", None), name


def test_a_mixer_missing_a_method_is_refused_at_registration():
    registry = Registry("variant", DepthMixer)

    class Partial(DepthMixer):
        @dataclass
        class Config:
            pass

        def init_state(self, e):
            return e

        def read(self, state, layer):
            return state

        def write(self, state, layer, out):
            return state + out

        def read_head(self, state):
            return state

    with pytest.raises(TypeError, match="extra_flops_per_token, mixing_matrix, stream_floats_per_token"):
        registry.add("partial", Partial)
    assert "partial" not in registry.names()


def test_a_complete_mixer_registers_and_runs_in_the_decoder():
    from harness.config import model_preset
    from harness.model.decoder import Decoder

    registry = Registry("variant", DepthMixer)

    @registry.register("plain-sum")
    class PlainSum(DepthMixer):
        """The residual stream, written out from the interface alone."""

        @dataclass
        class Config:
            pass

        def init_state(self, e):
            return e

        def read(self, state, layer):
            return state

        def write(self, state, layer, out):
            return state + out

        def read_head(self, state):
            return state

        def mixing_matrix(self, trace):
            raise AssertionError("not called here")

        def stream_floats_per_token(self):
            return self.d_model

        def extra_flops_per_token(self):
            return 0

    cfg = model_preset("tiny")
    entry, knobs = registry.config("plain-sum")
    model = Decoder(cfg, entry.cls(knobs, d_model=cfg.d_model, n_layers=2 * cfg.n_blocks))
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.isfinite(model(idx)).all()
