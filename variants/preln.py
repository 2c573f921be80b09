"""PreLN: the residual stream, the baseline every other variant is measured against (spec §2).

``S = (x)``, ``x_{-1} = e``, ``Read(x) = x``, ``Write(x, v) = x + v``, ``Read_head(x) = x``. With the Llama
decoder this is exactly Hugging Face's ``LlamaForCausalLM``.
"""

from __future__ import annotations

from dataclasses import dataclass

from variants.base import DepthMixer, prefix_ones, register


@register("preln")
class PreLN(DepthMixer):
    """Pre-norm residual stream: each layer adds its output to the running sum (the baseline)."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        pass

    def init_state(self, e):
        return e

    def read(self, x, layer):
        return x

    def write(self, x, layer, out):
        return x + out

    def read_head(self, x):
        return x

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        c = prefix_ones(self.n_layers, trace.embed)
        return c[None, None, :, :, None].expand(b, t, -1, -1, 1)

    def stream_floats_per_token(self):
        return self.d_model

    def extra_flops_per_token(self):
        return 0
