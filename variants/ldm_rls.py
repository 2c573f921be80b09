"""The exact depth-regression memory of LDM-RLS (spec §4): recursive least squares over depth, one step per write.

Per group the memory ``M`` (dv × dk) is the minimizer of ``Σ_i β_{n,i} ω_i ||v_i − M k_i||² + α⁻¹ β_{n,-1} ||M||²``
after write ``n``, with forgetting ``β_{n,i} = Π_{j=i+1..n} λ_j``. ``rls_write`` keeps it exactly with the inverse
key covariance ``P`` (dk × dk); ``closed_form_memory`` solves the same objective directly, as the reference the
recursion is tested against. The registered variant is ``ldm-rls`` in ``variants/ldm.py``, which calls these.

Axes: ``...`` any leading batch axes (b t for the model), g groups, v value width d/G, k key width d_k,
n writes in depth order.
"""

from __future__ import annotations

import math

import torch

LAMBDA_MIN = 0.5
"""Lower end of a learned forgetting factor: ``λ = λ_min + (1 − λ_min)·sigmoid(θ)``."""
LAMBDA_INIT = 0.99
"""A learned λ starts here: forget slowly, as the method text suggests."""


def theta_for_lambda(lam: float = LAMBDA_INIT) -> float:
    """The θ at which a learned forgetting factor equals ``lam``."""
    p = (lam - LAMBDA_MIN) / (1.0 - LAMBDA_MIN)
    return math.log(p / (1.0 - p))


def forgetting_factor(theta: torch.Tensor) -> torch.Tensor:
    """λ in [λ_min, 1] from the unconstrained parameter θ."""
    return LAMBDA_MIN + (1.0 - LAMBDA_MIN) * torch.sigmoid(theta)


def importance_weight(z: torch.Tensor) -> torch.Tensor:
    """ω = 2·sigmoid(z), so ω = 1 at z = 0 and ω ∈ (0, 2)."""
    return 2.0 * torch.sigmoid(z)


def initial_inverse_covariance(alpha: float, batch: tuple[int, ...], key_dim: int, *, dtype, device) -> torch.Tensor:
    """``P_{-1} = α I`` for every leading index, shape (*batch, k, k), as a broadcast view (no copy)."""
    eye = alpha * torch.eye(key_dim, dtype=dtype, device=device)
    return eye.expand(*batch, key_dim, key_dim)


def rls_write(M: torch.Tensor | None, P: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              lam: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One exact RLS step for every leading index and group at once: the new ``(M, P)``.

    Shapes: ``M`` (..., g, v, k) or None for the zero memory, ``P`` (..., g, k, k), ``k`` (..., g, k),
    ``v`` (..., g, v), ``lam`` and ``omega`` broadcastable to (..., g).
    """
    root = omega.sqrt().unsqueeze(-1)  # (..., g, 1)
    kb, vb = root * k, root * v  # k̄ = √ω k, v̄ = √ω v
    Pk = torch.einsum("...ij,...j->...i", P, kb)  # P k̄, (..., g, k)
    s = lam + (kb * Pk).sum(-1)  # λ + k̄ᵀ P k̄, (..., g)
    gain = Pk / s.unsqueeze(-1)  # κ
    # u: what the memory failed to predict.
    u = vb if M is None else vb - torch.einsum("...vk,...k->...v", M, kb)
    step = u.unsqueeze(-1) * gain.unsqueeze(-2)  # u κᵀ, (..., g, v, k)
    M = step if M is None else M + step
    # κ k̄ᵀ P equals (P k̄)(P k̄)ᵀ / s for symmetric P; written this way every entry is the same product
    # Pk_i·Pk_j for (i, j) and (j, i), so P stays exactly symmetric by construction and needs no symmetrizing.
    P = (P - Pk.unsqueeze(-1) * Pk.unsqueeze(-2) / s[..., None, None]) / lam[..., None, None]
    return M, P


def closed_form_memory(keys: torch.Tensor, values: torch.Tensor, lambdas: torch.Tensor, omegas: torch.Tensor,
                       alpha: float) -> torch.Tensor:
    """The weighted, forgetting ridge solution after every write, by direct solve: (n, ..., v, k).

    ``M_n = (Σ_{i≤n} β_{n,i} ω_i v_i k_iᵀ)(Σ_{i≤n} β_{n,i} ω_i k_i k_iᵀ + α⁻¹ β_{n,-1} I)⁻¹``. Shapes: ``keys``
    (n, ..., k), ``values`` (n, ..., v), ``lambdas`` and ``omegas`` broadcastable to (n, ...). A reference for
    tests, written for clarity: it loops over writes.
    """
    n_writes, key_dim = keys.shape[0], keys.shape[-1]
    lambdas = torch.broadcast_to(lambdas, keys.shape[:-1])
    omegas = torch.broadcast_to(omegas, keys.shape[:-1])
    eye = torch.eye(key_dim, dtype=keys.dtype, device=keys.device)
    out = []
    for n in range(n_writes):
        # beta[i] = Π_{j=i+1..n} λ_j for i = -1..n, so beta[0] is the ridge term's β_{n,-1}.
        later = torch.cat([lambdas[: n + 1], torch.ones_like(lambdas[:1])])  # λ_0..λ_n, 1
        beta = torch.flip(torch.cumprod(torch.flip(later, [0]), 0), [0])  # (n+2, ...)
        w = (beta[1:] * omegas[: n + 1]).unsqueeze(-1)  # β_{n,i} ω_i, (n+1, ..., 1)
        cross = torch.einsum("i...v,i...k->...vk", w * values[: n + 1], keys[: n + 1])
        cov = torch.einsum("i...a,i...b->...ab", w * keys[: n + 1], keys[: n + 1])
        cov = cov + (beta[0] / alpha)[..., None, None] * eye
        # M C = S with C symmetric: solve Cᵀ Mᵀ = Sᵀ.
        out.append(torch.linalg.solve(cov, cross.transpose(-1, -2)).transpose(-1, -2))
    return torch.stack(out)
