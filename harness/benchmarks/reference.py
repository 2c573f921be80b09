"""The straightforward implementation each variant is measured beside: its mixer's reference ``impl``, or for
PreLN the plain pre-norm trunk written out on the decoder's own blocks. A mixer that runs one implementation (no
``impl``) has none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BASELINE = "preln"


# A mixer with more than one implementation is measured beside the straightforward one of its own math, the
# ``mixer.impl`` named below. PreLN's reference is the plain pre-norm trunk (``PlainPreLN``).
REFERENCE = ":reference"


REFERENCE_IMPLS = {"ldm": "recurrent", "ldm-rls": "recurrent"}


def base_name(name: str) -> str:
    return name.split("(", 1)[0]


def reference_impl(name: str, mixer) -> str | None:
    """The ``impl`` of ``mixer`` that is the straightforward form of its math, or None when it has no other."""
    if not hasattr(mixer, "impl"):
        return None
    return REFERENCE_IMPLS.get(base_name(name))


class PlainPreLN(torch.nn.Module):
    """The plain pre-norm trunk a PreLN decoder is held to: ``x ← x + F_l(RMSNorm_l(x))`` written out, with no
    depth-mixing interface, on the decoder's own parameters and blocks (``F.rms_norm`` for the norms)."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, idx):
        m = self.decoder
        x = m.embed(idx)  # (b, t, d)
        for layer in m.layers:
            x = x + layer.fn(F.rms_norm(x, x.shape[-1:], layer.norm.weight, layer.norm.eps))
        return m.lm_head(F.rms_norm(x, x.shape[-1:], m.final_norm.weight, m.final_norm.eps))


def reference_model(name: str, model):
    """The straightforward implementation beside ``model`` (same weights), and the ``impl`` it runs, or None."""
    import copy

    if base_name(name) == BASELINE:
        return PlainPreLN(model), "plain pre-norm trunk"
    impl = reference_impl(name, model.mixer)
    if impl is None or impl == model.mixer.impl:
        return None
    ref = copy.deepcopy(model)
    ref.mixer.impl = impl
    return ref, impl
