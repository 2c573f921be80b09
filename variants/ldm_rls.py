"""LDM-RLS (spec §4): the linear depth memory of ``variants/ldm.py`` with the exact recursive-least-squares write,
forgetting λ, importance ω and ridge α. The model is ``LDM`` with ``write=rls``; its memory math (the recursion, the
dual form's whitening and the closed forms it is tested against) lives in ``variants/ops/rls.py`` and is importable
from here too.
"""

from __future__ import annotations

from variants.base import register
from variants.ldm import LDM
from variants.ops.rls import (  # noqa: F401  (the memory math, importable from the variant's module)
    LAMBDA_INIT,
    LAMBDA_MIN,
    closed_form_memory,
    forgetting_factor,
    importance_weight,
    initial_inverse_covariance,
    min_margin,
    read_weights,
    ridge_diagonal,
    rls_write,
    theta_for_lambda,
    whiten_plain,
)

register(
    "ldm-rls",
    defaults={"write": "rls"},
    description="LDM with the exact recursive-least-squares memory: forgetting λ, importance ω, ridge α",
)(LDM)
