"""LDM-RLS (spec §4): the linear depth memory of ``variants/ldm.py`` with the exact recursive-least-squares write,
forgetting λ, importance ω and ridge α. The model is ``LDM`` with ``write=rls``; its memory math (the recursion, the
dual form's whitening and the closed forms it is tested against) lives in ``variants/ops/rls.py``.

``scalar_lr`` defaults to 10 here (``ldm``'s outer write has no λ or ω to move): at 1 the learned forgetting
factors stay within 0.01 of 0.99 in short runs; at 10 they move (docs/variants.md, §5).
"""

from __future__ import annotations

from variants.base import register
from variants.ldm import LDM

register(
    "ldm-rls",
    defaults={"write": "rls", "scalar_lr": 10.0},
    description="LDM with the exact recursive-least-squares memory: forgetting λ, importance ω, ridge α",
)(LDM)
