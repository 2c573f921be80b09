"""The exact depth-regression memory of LDM-RLS (spec §4): recursive least squares over depth, one step per write.

Per group the memory ``M`` (dv × dk) is the minimizer of ``Σ_i β_{n,i} ω_i ||v_i − M k_i||² + α⁻¹ β_{n,-1} ||M||²``
after write ``n``, with forgetting ``β_{n,i} = Π_{j=i+1..n} λ_j``. ``rls_write`` keeps it exactly with the inverse
key covariance ``P`` (dk × dk). The same memory has a dual form (kernel ridge regression over depth):
``M q = Σ_i r_i v_i`` with ``r = (K Kᵀ + D)⁻¹ K q``, ``D = diag(d_i)``, ``d_i = Π_{j≤i} λ_j / (α ω_i)``; since
``D`` does not depend on the reader, the Cholesky factor ``K Kᵀ + D = L Lᵀ`` only grows by one row per write, and
with ``k̃ = L⁻¹K``, ``ṽ = L⁻¹V`` the memory is ``M = Σ_i ṽ_i k̃_iᵀ``: a plain outer-product memory of whitened
writes, which ``whiten`` computes one Gram–Schmidt step at a time. ``closed_form_memory`` and ``read_weights`` solve
the objective directly, as the references both forms are tested against. The variant is ``ldm-rls``
(``variants/ldm_rls.py``); ``variants/ldm.py`` computes its memory with these functions.

Precision. The dual form is exact in exact arithmetic, but its Gram matrix ``K Kᵀ + D`` is as ill-conditioned as
``D``'s range: with forgetting, ``d_i`` shrinks like ``Π λ`` (to ~1e-15 after 48 writes at λ = 0.5) while the keys
of more writes than key dimensions are linearly dependent, so the Schur complement ``δ²`` of a late write is a
tiny difference of O(1) numbers and float32 loses it (relative errors up to 1 and beyond were measured). The
regression itself stays well conditioned (a float32 rounding of its inputs moves the float64 answer by ~1e-7).
``whiten`` therefore also returns its margin, the smallest ``δ² / (|k|² + d_n)``: the relative size of what
survives the cancellation. Above ``min_margin(dtype)`` the dual form is accurate (the measured error stays below
1e-5 in float32); below it the memory switches, for the rest of that forward pass, to the recursion in float64
(``replay``), which is accurate at every tested λ, depth, key width and group count. Measurements are in
docs/ldm-performance.md.

Axes: ``...`` any leading batch axes (b t for the model), g groups, v value width d/G, k key width d_k,
n writes in depth order.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from variants.kernels.whiten import whiten as kernel_whiten
from variants.ops import _bdot

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


def _normalization_backward(dkt, dvt, kt, vt, delta, floored):
    """Through ``k̃ = k_rest / δ``, ``ṽ = v_rest / δ`` and ``δ = √(δ²)`` (floored at ``d_n``): the gradients of
    ``k_rest``, ``v_rest``, ``δ²`` and of the ridge entry ``d_n``."""
    if dkt is None:
        dkt = torch.zeros_like(kt)
    if dvt is None:
        dvt = torch.zeros_like(vt)
    dkr, dvr = dkt / delta, dvt / delta
    # δ = √(δ²): d(δ²) = dδ / 2δ, and dδ = −(dk̃·k̃ + dṽ·ṽ) / δ.
    dsq = (_bdot(dkt, kt) + _bdot(dvt, vt)).div_(delta.square()).mul_(-0.5)
    dridge = dsq.squeeze(-1)  # d_n enters δ² (or is δ² where floored) with weight 1
    dsq = dsq.masked_fill(floored, 0.0)  # where floored, δ² does not depend on k or the l_j
    return dkr, dvr, dsq, dridge


def _projections_backward(dk, dkr, dvr, dsq, k, coeffs, keys, values, grads):
    """Through ``k_rest −= l_j k̃_j``, ``v_rest −= l_j ṽ_j``, ``δ² −= l_j²`` with ``l_j = k̃_jᵀ k``, one earlier
    write at a time: adds into ``dk`` and returns the writes' gradients, or adds them into their collectors
    (``grads``, None in the lists then)."""
    dkeys, dvalues = [], []
    for c, kj, vj, grad in zip(coeffs, keys, values, grads):
        dc = (_bdot(dkr, kj) + _bdot(dvr, vj)).add_(c * dsq, alpha=2.0).neg_()
        dk.addcmul_(dc, kj)
        if grad is None:
            dkeys.append(torch.addcmul(dc * k, c, dkr, value=-1.0))
            dvalues.append(-c * dvr)
        else:
            grad.key.add(dc, k)
            grad.key.add(-c, dkr)
            grad.value.add(-c, dvr)
            dkeys.append(None)
            dvalues.append(None)
    return dkeys, dvalues


def _whiten_open(k, k_rest, v_rest, sq, r, total, writes):
    """The end of a whitened write, shared by ``_Whiten`` and ``_CarriedWhiten``: project the open ``writes``
    (keys then values) out of ``k_rest``, ``v_rest`` and ``δ² = sq``, in place, floor δ² at ``d_n = r`` and divide
    by δ. Returns ``(k̃, ṽ, δ, floored, margin)``, ``margin`` the smallest ``δ² / (|k|² + d_n)``."""
    n = len(writes) // 2
    for kj, vj in zip(writes[:n], writes[n:]):
        c = _bdot(kj, k)  # l_j, (..., g, 1)
        k_rest.addcmul_(c, kj, value=-1.0)
        v_rest.addcmul_(c, vj, value=-1.0)
        sq.addcmul_(c, c, value=-1.0)
    # δ² is the Schur complement of K Kᵀ + D, never below d_n in exact arithmetic (K Kᵀ's part is at most |k|²);
    # the floor keeps rounding from taking it to zero or below.
    floored = sq < r
    sq = torch.maximum(sq, r)
    margin = (sq / total).min()  # exactly 1 without earlier writes: δ² is then |k|² + d_n itself
    delta = sq.sqrt_()
    return k_rest.div_(delta), v_rest.div_(delta), delta, floored, margin


class _Whiten(torch.autograd.Function):
    """One Gram–Schmidt step of the dual form with its backward written out (autograd's took most of ldm-rls's
    extra time: a fresh gradient tensor per earlier write and operation). ``apply(k, v, ridge, grads, *keys,
    *values)``; ``grads`` holds one gradient collector per earlier write (``depth_read.WriteGradient``, or None to
    return that write's gradient to autograd), into which the backward adds in place, as the depth reads do."""

    @staticmethod
    def forward(ctx, k, v, ridge, grads, *writes):
        r = ridge.unsqueeze(-1)
        total = _bdot(k, k) + r
        kt, vt, delta, floored, margin = _whiten_open(k, k.clone(), v.clone(), total.clone(), r, total, writes)
        ctx.grads = grads
        # Not the coefficients, one (..., g, 1) tensor per earlier write, O(L²) over the depth: backward takes the
        # same dot products again.
        ctx.save_for_backward(k, kt, vt, delta, floored, *writes)
        ctx.mark_non_differentiable(margin)
        return kt, vt, margin

    @staticmethod
    @once_differentiable
    def backward(ctx, dkt, dvt, _):
        k, kt, vt, delta, floored, *rest = ctx.saved_tensors
        n = len(rest) // 2
        keys, values = rest[:n], rest[n:]
        coeffs = [_bdot(kj, k) for kj in keys]
        dkr, dvr, dsq, dridge = _normalization_backward(dkt, dvt, kt, vt, delta, floored)
        dk = torch.addcmul(dkr, k, dsq, value=2.0)
        dkeys, dvalues = _projections_backward(dk, dkr, dvr, dsq, k, coeffs, keys, values, ctx.grads)
        return dk, dvr, dridge, None, *dkeys, *dvalues


class _CarriedWhiten(torch.autograd.Function):
    """``_Whiten`` after writes folded into a carried memory (``variants/ops/depth_read.py``, with the keys' Gram
    ``S``): over the folded writes ``Σ l_j k̃_j = S k``, ``Σ l_j ṽ_j = M k`` and ``Σ l_j² = kᵀ S k``, so they cost
    three batched products whatever their number; the writes since the latest fold are projected out one by one
    as in ``_Whiten``. ``apply(k, v, ridge, memory, token, grads, *keys, *values)``; ``token`` orders the backward
    passes as for a read. ``S`` is symmetric (a sum of ``k̃ k̃ᵀ``), so ``∂(kᵀ S k)/∂k = 2 S k``."""

    @staticmethod
    def forward(ctx, k, v, ridge, memory, token, grads, *writes):
        r = ridge.unsqueeze(-1)
        total = _bdot(k, k) + r
        # [M k; S k] as one row-vector product on the memories' shared buffer (``CarriedMemory``).
        MSk = torch.bmm(k.reshape(-1, 1, k.shape[-1]), memory.MS.mT).view(*k.shape[:-1], -1)
        Mk, Sk = MSk.split([v.shape[-1], k.shape[-1]], dim=-1)
        Sk = Sk.contiguous()  # for the batched dot product below
        k_rest = k - Sk
        v_rest = v - Mk
        sq = total - _bdot(k, Sk)
        kt, vt, delta, floored, margin = _whiten_open(k, k_rest, v_rest, sq, r, total, writes)
        ctx.memory, ctx.phase, ctx.grads = memory, memory.phase, grads
        # Neither S k nor the coefficients: backward makes what it needs of them again from the whitened write
        # and the open writes, rather than keep a (b, t, g, k) tensor per write.
        ctx.save_for_backward(k, kt, vt, delta, floored, *writes)
        ctx.mark_non_differentiable(margin)
        return kt, vt, margin

    @staticmethod
    @once_differentiable
    def backward(ctx, dkt, dvt, _):
        k, kt, vt, delta, floored, *rest = ctx.saved_tensors
        n = len(rest) // 2
        keys, values = rest[:n], rest[n:]
        coeffs = [_bdot(kj, k) for kj in keys]
        memory, phase = ctx.memory, ctx.phase
        memory.at(phase)
        dkr, dvr, dsq, dridge = _normalization_backward(dkt, dvt, kt, vt, delta, floored)
        # k_rest = k − S k − Σ l_j k̃_j, v_rest = v − M k − Σ l_j ṽ_j, δ² = |k|² + d_n − kᵀ S k − Σ l_j².
        # ∂δ²/∂k = 2 (k − S k), and k − S k = δ k̃ + Σ l_j k̃_j over the open writes: a few elementwise passes
        # instead of keeping S k per write or taking the product again.
        k_Sk = kt * delta
        for c, kj in zip(coeffs, keys):
            k_Sk.addcmul_(c, kj)
        dk = torch.addcmul(dkr, k_Sk, dsq, value=2.0)
        del k_Sk
        B = k.numel() // k.shape[-1]  # tokens × groups, the batch of the carried products
        k_flat = k.reshape(B, -1)
        dk -= torch.bmm(torch.cat([dvr, dkr], -1).reshape(B, 1, -1), memory.MS).view_as(k)  # Mᵀ ∂ṽ + Sᵀ ∂k̃
        memory.owe(phase, "S", torch.addcmul(dkr, k, dsq).reshape(B, -1), k_flat, sign=-1.0)
        memory.owe(phase, "M", dvr.reshape(B, -1), k_flat, sign=-1.0)
        dkeys, dvalues = _projections_backward(dk, dkr, dvr, dsq, k, coeffs, keys, values, ctx.grads)
        return dk, dvr, dridge, None, None, None, *dkeys, *dvalues


def whiten(
    k: torch.Tensor,
    v: torch.Tensor,
    ridge: torch.Tensor,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    grads: tuple | None = None,
    carried=None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The whitened write ``(k̃_n, ṽ_n)``: ``(k, v)`` with the earlier whitened writes projected out, over ``δ``; and
    the margin ``min δ² / (|k|² + d_n)`` over every leading index and group (a float; 1 for the first write).

    Shapes: ``k`` (..., g, k), ``v`` (..., g, v), ``ridge`` (..., g) the ``d_n`` of this write, ``keys`` and
    ``values`` the earlier ``k̃_j`` (..., g, k) and ``ṽ_j`` (..., g, v); ``grads`` optionally one gradient collector
    per earlier write (see ``_Whiten``). The coefficients ``l_j = k̃_jᵀ k`` are the new row of ``L`` and
    ``δ² = |k|² + d_n − |l|²`` its diagonal entry. The margin is how much of ``|k|² + d_n`` survives that
    subtraction: rounding errors in ``δ²`` are relative to ``|k|² + d_n``, so a margin near the precision's epsilon
    means ``δ`` (and every later read) has lost its digits. With ``carried`` (the ``(memory, token)`` of chunked
    reads, ``variants/ops/depth_read.py``) the earlier writes are the folded ones in its memory and ``keys``.
    """
    if grads is None:
        grads = (None,) * len(keys)
    if carried is not None:
        memory, token = carried
        kt, vt, margin = _CarriedWhiten.apply(k, v, ridge, memory, token, grads, *keys, *values)
        return kt, vt, float(margin)
    kt, vt, margin = _Whiten.apply(k, v, ridge, grads, *keys, *values)
    return kt, vt, float(margin)


def whiten_plain(
    k: torch.Tensor,
    v: torch.Tensor,
    ridge: torch.Tensor,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``whiten`` for ``torch.compile`` and the GPU: the same Gram–Schmidt step as the fused kernel of
    ``variants/kernels/whiten/`` where it runs and as plain tensor operations elsewhere, and the margin as a tensor,
    which the caller keeps on the device rather than deciding on it here. Shapes as in ``whiten``."""
    lead, R = k.shape[:-1], k.numel() // k.shape[-1]
    if len(keys):
        K, V = torch.stack(keys, -2).view(R, len(keys), -1), torch.stack(values, -2).view(R, len(keys), -1)
    else:
        K, V = k.new_empty(R, 0, k.shape[-1]), v.new_empty(R, 0, v.shape[-1])
    ridge = torch.broadcast_to(ridge, lead).reshape(R)
    kt, vt, margin = kernel_whiten(k.reshape(R, -1), v.reshape(R, -1), ridge, K, V)
    return kt.view(k.shape), vt.view(v.shape), margin.amin()


def min_margin(dtype: torch.dtype) -> float:
    """The smallest ``whiten`` margin at which the dual form is still accurate in ``dtype``: 1e-2 in float32
    (measured: reads within 1e-5 of float64 above it), scaled by the precision's epsilon for other dtypes."""
    return 1e-2 * torch.finfo(dtype).eps / torch.finfo(torch.float32).eps


def replay(writes, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The recursion's ``(M, P)`` in float64 after ``writes``, a sequence of ``(k, v, λ, ω)`` as ``rls_write``
    takes them: the exact memory the dual form hands over to when its margin runs out."""
    k0 = writes[0][0]
    P = initial_inverse_covariance(alpha, k0.shape[:-1], k0.shape[-1], dtype=torch.float64, device=k0.device)
    M = None
    for k, v, lam, omega in writes:
        M, P = rls_write(M, P, k.double(), v.double(), lam.double(), omega.double())
    return M, P


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
