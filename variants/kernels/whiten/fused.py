"""LDM-RLS's write as Triton kernels: a tile of rows per program streams each earlier whitened write once.

Forward, per row: the coefficients ``l_j = k̃_jᵀ k`` and the projections out of ``k``, ``v`` and ``|k|² + d`` in one
pass over the earlier writes, then the floor and the division by ``δ`` (``naive.py``). It keeps ``δ`` and whether
the floor held, one number each per row, for backward, which recomputes the coefficients in one more pass:

    ∂k_r = ∂k̃ / δ,  ∂v_r = ∂ṽ / δ,  ∂δ² = −(∂k̃·k̃ + ∂ṽ·ṽ) / 2δ²   (0 for k and l where the floor held; ∂d = ∂δ²)
    ∂l_j = −(∂k_r·k̃_j + ∂v_r·ṽ_j) − 2 l_j ∂δ²
    ∂k = ∂k_r + 2 ∂δ² k + Σ_j ∂l_j k̃_j,   ∂k̃_j = ∂l_j k − l_j ∂k_r,   ∂ṽ_j = −l_j ∂v_r

Inputs may be float64, float32, bfloat16 or float16, each its own (the earlier writes kept in bfloat16, say): they
are widened as they are loaded and the arithmetic is in ``ACC``, float64 where an input is float64 and float32
otherwise; ``k̃``, ``ṽ``, the margin and ``δ`` come out in ``ACC`` (the caller casts them), each gradient in its
input's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from variants import kernels
from variants.kernels import tiles
from variants.kernels.tiles import row_tile

PER_THREAD = 4  # elements of each tile per thread: one 16-byte load of float32


@triton.jit
def _forward(
    K0, V0, RIDGE, KS, VS, KT, VT, DELTA, FLOORED, MARGIN, R, n, KD, VD,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows, ok, ov, rmask, kmask, vmask = row_tile(R, KD, VD, BLOCK_R, BLOCK_K, BLOCK_V)
    k = tl.load(K0 + rows[:, None] * KD + ok[None, :], mask=kmask, other=0.0).to(ACC)
    v = tl.load(V0 + rows[:, None] * VD + ov[None, :], mask=vmask, other=0.0).to(ACC)
    r = tl.load(RIDGE + rows, mask=rmask, other=1.0).to(ACC)
    total = tl.sum(k * k, 1) + r
    k_rest, v_rest, sq = k, v, total
    for j in range(n):
        kj = tl.load(KS + (rows[:, None] * n + j) * KD + ok[None, :], mask=kmask, other=0.0).to(ACC)
        vj = tl.load(VS + (rows[:, None] * n + j) * VD + ov[None, :], mask=vmask, other=0.0).to(ACC)
        c = tl.sum(kj * k, 1)
        k_rest -= c[:, None] * kj
        v_rest -= c[:, None] * vj
        sq -= c * c
    floored = sq < r
    sq = tl.maximum(sq, r)
    delta = tl.sqrt(sq)
    tl.store(KT + rows[:, None] * KD + ok[None, :], k_rest / delta[:, None], mask=kmask)
    tl.store(VT + rows[:, None] * VD + ov[None, :], v_rest / delta[:, None], mask=vmask)
    tl.store(DELTA + rows, delta, mask=rmask)
    tl.store(FLOORED + rows, floored.to(tl.int8), mask=rmask)
    tl.store(MARGIN + rows, sq / total, mask=rmask)


@triton.jit
def _backward(
    K0, KS, VS, KT, VT, DELTA, FLOORED, DKT, DVT, DK0, DV0, DRIDGE, DKS, DVS, R, n, KD, VD,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows, ok, ov, rmask, kmask, vmask = row_tile(R, KD, VD, BLOCK_R, BLOCK_K, BLOCK_V)
    at_k, at_v = rows[:, None] * KD + ok[None, :], rows[:, None] * VD + ov[None, :]
    k = tl.load(K0 + at_k, mask=kmask, other=0.0).to(ACC)
    kt = tl.load(KT + at_k, mask=kmask, other=0.0).to(ACC)
    vt = tl.load(VT + at_v, mask=vmask, other=0.0).to(ACC)
    dkt = tl.load(DKT + at_k, mask=kmask, other=0.0).to(ACC)
    dvt = tl.load(DVT + at_v, mask=vmask, other=0.0).to(ACC)
    delta = tl.load(DELTA + rows, mask=rmask, other=1.0)
    floored = tl.load(FLOORED + rows, mask=rmask, other=0) != 0
    dkr, dvr = dkt / delta[:, None], dvt / delta[:, None]
    dsq = -0.5 * (tl.sum(dkt * kt, 1) + tl.sum(dvt * vt, 1)) / (delta * delta)
    tl.store(DRIDGE + rows, dsq, mask=rmask)  # d enters δ² with weight 1, or is δ² where the floor held
    dsq = tl.where(floored, 0.0, dsq)
    dk = dkr + 2.0 * dsq[:, None] * k
    for j in range(n):
        jk = (rows[:, None] * n + j) * KD + ok[None, :]
        jv = (rows[:, None] * n + j) * VD + ov[None, :]
        kj = tl.load(KS + jk, mask=kmask, other=0.0).to(ACC)
        vj = tl.load(VS + jv, mask=vmask, other=0.0).to(ACC)
        c = tl.sum(kj * k, 1)
        dc = -(tl.sum(dkr * kj, 1) + tl.sum(dvr * vj, 1)) - 2.0 * c * dsq
        dk += dc[:, None] * kj
        tl.store(DKS + jk, dc[:, None] * k - c[:, None] * dkr, mask=kmask)
        tl.store(DVS + jv, -c[:, None] * dvr, mask=vmask)
    tl.store(DK0 + at_k, dk, mask=kmask)
    tl.store(DV0 + at_v, dvr, mask=vmask)


def launch(R: int, n: int, KD: int, VD: int, acc=tl.float32) -> tuple[tuple[int], tuple[int, ...], dict]:
    """The grid, the sizes and the tile (constexprs and warps) of both kernels for ``R`` rows of ``n`` writes,
    computed in ``acc``."""
    BLOCK_K, BLOCK_V = triton.next_power_of_2(KD), triton.next_power_of_2(VD)
    BLOCK_R = tiles.rows_per_program(max(BLOCK_K, BLOCK_V), PER_THREAD)
    blocks = dict(BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=tiles.WARPS, ACC=acc)
    return (triton.cdiv(R, BLOCK_R),), (R, n, KD, VD), blocks


def _launch(keys, values, *others):
    return launch(*keys.shape, values.shape[-1], tiles.compute_dtype(keys, values, *others))


def _outputs(k, v, ridge, keys, values):
    """Empty ``k̃``, ``ṽ``, margin, ``δ`` and the floor's mask (one byte per row) for these inputs, all but the
    mask in the dtype the kernel computes in: backward reads ``k̃`` and ``ṽ`` again, which must not carry a
    bfloat16 rounding into the gradients."""
    inputs = (k, v, ridge, keys, values)
    acc = kernels.compute_dtype(*inputs)
    rows = k.shape[0]
    floored = torch.empty(rows, dtype=torch.int8, device=k.device)
    kt, vt = k.new_empty(k.shape, dtype=acc), v.new_empty(v.shape, dtype=acc)
    return kt, vt, k.new_empty(rows, dtype=acc), k.new_empty(rows, dtype=acc), floored


@torch.library.custom_op("depthmem::whiten", mutates_args=())
def whiten(
    k: torch.Tensor, v: torch.Tensor, ridge: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``naive.whiten`` by the forward kernel, with ``δ`` and the floor's mask for backward."""
    grid, sizes, blocks = _launch(keys, values, k, v, ridge)
    kt, vt, margin, delta, floored = _outputs(k, v, ridge, keys, values)
    _forward[grid](k, v, ridge, keys, values, kt, vt, delta, floored, margin, *sizes, **blocks)
    return kt, vt, margin, delta, floored


whiten.register_fake(_outputs)


@torch.library.custom_op("depthmem::whiten_backward", mutates_args=())
def whiten_backward(
    dkt: torch.Tensor,
    dvt: torch.Tensor,
    k: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    delta: torch.Tensor,
    floored: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grid, sizes, blocks = _launch(keys, values, k, delta)
    dk, dv, dridge = torch.empty_like(k), torch.empty_like(vt), torch.empty_like(delta)
    dkeys, dvalues = torch.empty_like(keys), torch.empty_like(values)
    dkt, dvt = dkt.contiguous(), dvt.contiguous()
    _backward[grid](k, keys, values, kt, vt, delta, floored, dkt, dvt, dk, dv, dridge, dkeys, dvalues, *sizes, **blocks)
    return dk, dv, dridge, dkeys, dvalues


@whiten_backward.register_fake
def _(dkt, dvt, k, keys, values, kt, vt, delta, floored):
    return (
        torch.empty_like(k),
        torch.empty_like(vt),
        torch.empty_like(delta),
        torch.empty_like(keys),
        torch.empty_like(values),
    )


def _setup(ctx, inputs, output):
    k, v, ridge, keys, values = inputs
    kt, vt, _, delta, floored = output
    ctx.save_for_backward(k, keys, values, kt, vt, delta, floored)
    ctx.v_dtype, ctx.ridge_dtype = v.dtype, ridge.dtype
    ctx.mark_non_differentiable(output[2], delta, floored)


def _grad(ctx, dkt, dvt, *_):
    k, keys, values, kt, vt, delta, floored = ctx.saved_tensors
    dkt = torch.zeros_like(kt) if dkt is None else dkt
    dvt = torch.zeros_like(vt) if dvt is None else dvt
    dk, dv, dridge, dkeys, dvalues = whiten_backward(dkt, dvt, k, keys, values, kt, vt, delta, floored)
    # ∂v and ∂d come out in the computing dtype, ṽ's and δ's: one rounding to v's and d's
    return dk, dv.to(ctx.v_dtype), dridge.to(ctx.ridge_dtype), dkeys, dvalues


whiten.register_autograd(_grad, setup_context=_setup)
