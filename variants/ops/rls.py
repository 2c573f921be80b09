"""The exact depth-regression memory of LDM-RLS (spec §4): recursive least squares over depth, one step per write.

Per group the memory ``M`` (dv × dk) is the minimizer of ``Σ_i β_{n,i} ω_i ||v_i − M k_i||² + α⁻¹ β_{n,-1} ||M||²``
after write ``n``, with forgetting ``β_{n,i} = Π_{j=i+1..n} λ_j``. ``rls_write`` keeps it exactly with the inverse
key covariance ``P`` (dk × dk). The same memory has a dual form (kernel ridge regression over depth):
``M q = Σ_i r_i v_i`` with ``r = (K Kᵀ + D)⁻¹ K q``, ``D = diag(d_i)``, ``d_i = Π_{j≤i} λ_j / (α ω_i)``; since
``D`` does not depend on the reader, the Cholesky factor ``K Kᵀ + D = L Lᵀ`` only grows by one row per write, and
with ``k̃ = L⁻¹K``, ``ṽ = L⁻¹V`` the memory is ``M = Σ_i ṽ_i k̃_iᵀ``: a plain outer-product memory of whitened
writes, which ``whiten`` computes one Gram–Schmidt step at a time. ``closed_form_memory`` and
``read_weights`` solve the objective directly, as the references both forms are tested against. The variant is
``ldm-rls`` (``variants/ldm_rls.py``); ``variants/ldm.py`` computes its memory with these functions.

Precision. The dual form is exact in exact arithmetic, but its Gram matrix ``K Kᵀ + D`` is as ill-conditioned as
``D``'s range: with forgetting, ``d_i`` shrinks like ``Π λ`` (to ~1e-15 after 48 writes at λ = 0.5) while the keys
of more writes than key dimensions are linearly dependent, so the Schur complement ``δ²`` of a late write is a
tiny difference of O(1) numbers and float32 loses it (relative errors up to 1 and beyond were measured). The
regression itself is far better conditioned (a float32 rounding of its inputs moves the float64 answer by ~1e-7,
and by up to 4e-5 at 48 writes of λ = 0.5 with α = 0.1). ``whiten`` therefore also returns its margin, the
smallest ``δ² / (|k|² + d_n)``: the relative size of what survives the cancellation. Above ``min_margin(dtype)``
the dual form is accurate (the measured error stays below 1e-5 in float32). The margin is kept on the device and
read once per step (``LDM.step_checks``); once it has fallen below the floor, the model whitens in float64 from
the next step on, in the square-root form (``whiten_square_root``), which never forms that difference: float64
alone still lost up to 2e-3 of a read at the edge above. Measurements are in docs/ldm-performance.md.

Axes: ``...`` any leading batch axes (b t for the model), g groups, v value width d/G, k key width d_k,
n writes in depth order.
"""

from __future__ import annotations

import functools
import math

import torch

from variants.kernels.buffer import DepthBuffer
from variants.kernels.whiten.buffer import buffer_whiten
from variants.ops.recompute import recomputed

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
    """ω = 2·sigmoid(z), so ω = 1 at z = 0 and ω ∈ [ε², 2), with ε the precision of z's dtype.

    The floor keeps the gradient finite. ω enters the dual form through the ridge entry ``d = Π λ / (α ω)``, whose
    derivative ``−d / ω`` leaves float32's range once ω falls under about 5e-20 (a logit near −45, which large
    learning rates reach), while the loss, which hardly depends on such a write, stays finite: the gradient turns
    inf, then NaN. At ω = ε² that derivative is at most ``1 / (α ε⁴)`` (5e27 / α in float32), and a write's share of
    every later read, which scales with its ω, is far below the precision, so the floor changes no read that the
    dtype can resolve, nor any gradient a step would register (the logit's is about ω)."""
    return (2.0 * torch.sigmoid(z)).clamp_min(torch.finfo(z.dtype).eps ** 2)


def initial_inverse_covariance(alpha: float, batch: tuple[int, ...], key_dim: int, *, dtype, device) -> torch.Tensor:
    """``P_{-1} = α I`` for every leading index, shape (*batch, k, k), as a broadcast view (no copy)."""
    eye = alpha * torch.eye(key_dim, dtype=dtype, device=device)
    return eye.expand(*batch, key_dim, key_dim)


def rls_write(
    M: torch.Tensor | None, P: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, omega: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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


def closed_form_memory(
    keys: torch.Tensor, values: torch.Tensor, lambdas: torch.Tensor, omegas: torch.Tensor, alpha: float
) -> torch.Tensor:
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


def ridge_diagonal(decay: torch.Tensor, omega: torch.Tensor, alpha: float) -> torch.Tensor:
    """``d_i = Π_{j≤i} λ_j / (α ω_i)``: write ``i``'s entry of the dual form's diagonal.

    ``decay`` is ``Π_{j≤i} λ_j``."""
    return decay / (alpha * omega)


def whiten(
    k: torch.Tensor,
    v: torch.Tensor,
    ridge: torch.Tensor,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whitened write ``(k̃_n, ṽ_n)``: ``(k, v)`` with the earlier whitened writes projected out, over ``δ``; and
    the margin ``min δ² / (|k|² + d_n)`` over every leading index and group (1 for the first write), as a tensor,
    which the caller keeps on the device rather than deciding on it here.

    Shapes: ``k`` (..., g, k), ``v`` (..., g, v), ``ridge`` (..., g) the ``d_n`` of this write, ``keys`` and
    ``values`` the earlier ``k̃_j`` (..., g, k) and ``ṽ_j`` (..., g, v). The coefficients ``l_j = k̃_jᵀ k`` are the
    new row of ``L`` and ``δ² = |k|² + d_n − |l|²`` its diagonal entry. The margin is how much of ``|k|² + d_n``
    survives that subtraction: rounding errors in ``δ²`` are relative to ``|k|² + d_n``, so a margin near the
    precision's epsilon means ``δ`` (and every later read) has lost its digits.

    The model keeps its whitened writes in a depth buffer and whitens against it where they lie
    (``variants/kernels/whiten/buffer.py``, the fused kernel where it runs); this takes the earlier writes as
    tensors and copies them into such a buffer first, for references and tests. The result is in the whitening's
    computing dtype, float32 or float64."""
    shape, R = k.shape[:-1], k.numel() // k.shape[-1]
    ridge = torch.broadcast_to(ridge, shape).reshape(R)
    k, v = k.reshape(R, -1), v.reshape(R, -1)
    template = (keys[0].reshape(R, -1), values[0].reshape(R, -1)) if keys else (k, v)
    buffer = DepthBuffer.allocate(max(len(keys), 1), *template)
    for kj, vj in zip(keys, values):
        buffer = buffer.append(kj.reshape(R, -1), vj.reshape(R, -1))
    kt, vt, margin = buffer_whiten(buffer, k, v, ridge)
    return kt.view(*shape, -1), vt.view(*shape, -1), margin.amin()


def whiten_square_root(
    k: torch.Tensor,
    v: torch.Tensor,
    ridge: torch.Tensor,
    position: int,
    n_writes: int,
    writes: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``whiten`` in the square-root form: the same ``(k̃_n, ṽ_n)`` and margin, without the subtraction that
    cancels, at twice the arithmetic and ``n_writes`` more numbers kept per write: where LDM-RLS's guard sends a
    model whose float32 whitening lost its digits.

    The Gram matrix ``K Kᵀ + D`` is ``AᵀA`` for the columns ``a_i = [k_i; √d_i e_i]`` (``e_i`` the ``i``-th of
    ``n_writes`` unit vectors), and ``L`` is the ``R`` of their QR factorisation. Gram–Schmidt on these columns gives
    ``δ`` as the norm of what is left of ``a_n``, a sum of squares, where ``whiten`` subtracts ``|l|²`` from
    ``|k|² + d_n`` and so loses digits as ε / margin (float64 lost them at 48 writes of λ = 0.5). Classical
    Gram–Schmidt loses the columns' orthogonality as the square of their condition, so the projection runs twice,
    which keeps it to ε. The reads then lose digits as ε² / margin (measured against a 90-digit solve), hence
    ``min_margin``'s floor for this form.

    ``position`` is this write's index ``n`` of ``n_writes``; ``writes`` the earlier whitened keys, values and their
    coordinates along the ridge directions, ``c̃_j = (√D L⁻ᵀ)_j``, each (..., g, ``n_writes``). Returns
    ``(k̃_n, ṽ_n, c̃_n, margin)``, the margin as in ``whiten``."""
    keys, values, coords = writes
    return recomputed(
        functools.partial(_square_root_stacked, position, n_writes, len(keys)),
        k,
        v,
        torch.broadcast_to(ridge, k.shape[:-1]),
        *keys,
        *values,
        *coords,
    )


def _square_root_stacked(position: int, n_writes: int, n: int, k, v, ridge, *writes) -> tuple:
    """``whiten_square_root`` with the earlier writes given flat, as their keys, values, then coordinates."""
    unit = k.new_zeros(n_writes)
    unit[position] = 1.0
    top, rest, bottom = k, v, ridge.sqrt().unsqueeze(-1) * unit  # the column a_n: (..., k), (..., v), (..., n_writes)
    if n:
        K, V, C = (torch.stack(writes[i * n : (i + 1) * n], -2) for i in range(3))  # (..., n, k | v | n_writes)
        for _ in range(2):
            coeff = (K @ top.unsqueeze(-1) + C @ bottom.unsqueeze(-1)).mT  # l_j, (..., 1, n)
            top, rest, bottom = (x - (coeff @ X).squeeze(-2) for x, X in ((top, K), (rest, V), (bottom, C)))
    sq = top.square().sum(-1) + bottom.square().sum(-1)  # δ², never below d_n: c̃_j is zero at every later position
    delta = sq.sqrt().unsqueeze(-1)
    margin = sq / (k.square().sum(-1) + ridge)
    return top / delta, rest / delta, bottom / delta, margin.amin()


def min_margin(dtype: torch.dtype, square_root: bool = False) -> float:
    """The smallest whitening margin at which the dual form's reads are still accurate. ``whiten`` loses digits as
    ε / margin: 1e-2 in float32 (measured: reads within 1e-5 of float64 above it), scaled by the precision's ε for
    other dtypes. ``whiten_square_root`` (float64) loses them as ε² / margin: (1e3 ε)² ≈ 5e-26 (reads within about
    1e-6 of a 90-digit solve at that margin)."""
    eps = torch.finfo(dtype).eps
    if square_root:
        return (1e3 * eps) ** 2
    return 1e-2 * eps / torch.finfo(torch.float32).eps


def read_weights(keys: torch.Tensor, ridge: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``r = (K Kᵀ + diag(d))⁻¹ K q``, the weights with which a read ``M q = Σ_i r_i v_i`` holds each write, by a
    direct solve: ``keys`` (..., n, k), ``ridge`` (..., n), ``query`` (..., k) -> (..., n). A reference for tests
    and the mixing matrix.

    Computed in float64 as the least-squares problem ``min_r |[Kᵀ; diag(√d)] r − [q; 0]|`` by QR, whose condition is
    the square root of the Gram matrix's, so tiny ridge terms under strong forgetting do not spoil it."""
    dt = keys.dtype
    keys, ridge, query = keys.double(), ridge.double(), query.double()
    A = torch.cat([keys.mT, torch.diag_embed(ridge.sqrt())], -2)  # (..., k + n, n)
    b = torch.cat([query, query.new_zeros(*query.shape[:-1], keys.shape[-2])], -1).unsqueeze(-1)
    return torch.linalg.lstsq(A, b, driver="gels").solution.squeeze(-1).to(dt)
