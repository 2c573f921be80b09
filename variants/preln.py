"""PreLN: the residual stream, the baseline every other variant is measured against (spec §2).

``S = (x)``, ``x_{-1} = e``, ``Read(x) = x``, ``Write(x, v) = x + v``, ``Read_head(x) = x``. With the Llama
decoder this is exactly Hugging Face's ``LlamaForCausalLM``.

``preln(match=VARIANT)`` is the parameter-matched baseline: the same residual stream, with every MLP widened so
that the whole decoder has as many parameters as the decoder with ``VARIANT`` (within one MLP unit per block,
well under 0.5%). A variant that adds parameters is then also compared with a PreLN that spends them in the
most ordinary place.
"""

from __future__ import annotations

from dataclasses import dataclass

from variants.base import DepthMixer, prefix_ones, register
from variants.errors import UsageError
from variants.registry import knob


def _parse_match(text: str) -> str:
    """The canonical name of the variant to match (``ValueError`` for a name the registry does not know)."""
    from variants.base import REGISTRY

    text = text.strip()
    if not text:
        return ""
    try:
        return REGISTRY.canonical(text)
    except UsageError:
        raise ValueError(text) from None


@register("preln")
class PreLN(DepthMixer):
    """Pre-norm residual stream: each layer adds its output to the running sum (the baseline)."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        match: str = knob(
            "",
            "widen the MLPs to match the parameter count of this variant's model",
            parse=_parse_match,
            allowed="the name of another variant, e.g. ldm-rls(groups=4)",
        )

        def __post_init__(self):
            if self.match:
                from variants.base import REGISTRY

                _, other = REGISTRY.config(self.match)
                if getattr(other, "match", ""):
                    raise ValueError(f"match must name a variant that does not match another, got {self.match}")

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__(cfg, d_model=d_model, n_layers=n_layers)
        if cfg.match:
            from variants.base import REGISTRY

            entry, other = REGISTRY.config(cfg.match)
            try:  # the variant to match must exist at this size too
                entry.cls(other, d_model=d_model, n_layers=n_layers)
            except (UsageError, ValueError) as e:
                raise ValueError(f"the variant to match, {cfg.match}, does not fit this model: {e}") from None

    def params_to_match(self):
        return self.cfg.match or None

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
