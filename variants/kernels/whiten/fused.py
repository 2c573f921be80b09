"""LDM-RLS's write as Triton kernels: a tile of rows per program streams each earlier whitened write once, from a
depth buffer (``variants/kernels/buffer.py``), depth-major (capacity, R, ·).

Forward, per row: the coefficients ``l_j = k̃_jᵀ k`` and the projections out of ``k``, ``v`` and ``|k|² + d`` in one
pass over the earlier writes, then the floor and the division by ``δ`` (``naive.py``). It keeps ``δ`` and whether
the floor held, one number each per row, for backward, which recomputes the coefficients in one more pass:

    ∂k_r = ∂k̃ / δ,  ∂v_r = ∂ṽ / δ,  ∂δ² = −(∂k̃·k̃ + ∂ṽ·ṽ) / 2δ²   (0 for k and l where the floor held; ∂d = ∂δ²)
    ∂l_j = −(∂k_r·k̃_j + ∂v_r·ṽ_j) − 2 l_j ∂δ²
    ∂k = ∂k_r + 2 ∂δ² k + Σ_j ∂l_j k̃_j,   ∂k̃_j = ∂l_j k − l_j ∂k_r,   ∂ṽ_j = −l_j ∂v_r

each ``∂k̃_j`` and ``∂ṽ_j`` added into the buffer's float32 gradient in place.

Inputs may be float64, float32, bfloat16 or float16, each its own (the earlier writes kept in bfloat16, say): they
are widened as they are loaded and the arithmetic is in ``ACC``, float64 where an input is float64 and float32
otherwise; ``k̃``, ``ṽ``, the margin and ``δ`` come out in ``ACC`` (the caller casts them), each gradient in its
input's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from variants.kernels import tiles
from variants.kernels.tiles import row_tile
from variants.kernels.whiten.naive import outputs

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
        at = j * R + rows[:, None]  # earlier write j of row r: depth-major
        kj = tl.load(KS + at * KD + ok[None, :], mask=kmask, other=0.0).to(ACC)
        vj = tl.load(VS + at * VD + ov[None, :], mask=vmask, other=0.0).to(ACC)
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
        at = j * R + rows[:, None]
        jk, jv = at * KD + ok[None, :], at * VD + ov[None, :]
        kj = tl.load(KS + jk, mask=kmask, other=0.0).to(ACC)
        vj = tl.load(VS + jv, mask=vmask, other=0.0).to(ACC)
        c = tl.sum(kj * k, 1)
        dc = -(tl.sum(dkr * kj, 1) + tl.sum(dvr * vj, 1)) - 2.0 * c * dsq
        dk += dc[:, None] * kj
        # Added into the buffer's gradient: this row's own slots, which no other program touches.
        dkj = dc[:, None] * k - c[:, None] * dkr + tl.load(DKS + jk, mask=kmask, other=0.0).to(ACC)
        dvj = -c[:, None] * dvr + tl.load(DVS + jv, mask=vmask, other=0.0).to(ACC)
        tl.store(DKS + jk, dkj, mask=kmask)
        tl.store(DVS + jv, dvj, mask=vmask)
    tl.store(DK0 + at_k, dk, mask=kmask)
    tl.store(DV0 + at_v, dvr, mask=vmask)


def launch(R: int, n: int, KD: int, VD: int, acc=tl.float32) -> tuple[tuple[int], tuple[int, ...], dict]:
    """The grid, the sizes and the tile (constexprs and warps) of both kernels for ``R`` rows of ``n`` earlier
    writes, computed in ``acc``."""
    BLOCK_K, BLOCK_V = triton.next_power_of_2(KD), triton.next_power_of_2(VD)
    BLOCK_R = tiles.rows_per_program(max(BLOCK_K, BLOCK_V), PER_THREAD)
    blocks = dict(BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=tiles.WARPS, ACC=acc)
    return (triton.cdiv(R, BLOCK_R),), (R, n, KD, VD), blocks


def buffer_whiten(k, v, ridge, keys, values, n: int):
    """``k̃``, ``ṽ``, the margin, ``δ`` and the floor's mask against ``keys[:n]`` and ``values[:n]``."""
    grid, sizes, blocks = launch(k.shape[0], n, k.shape[1], v.shape[1], tiles.compute_dtype(k, v, ridge, keys, values))
    kt, vt, margin, delta, floored = outputs(k, v, ridge, keys, values)
    _forward[grid](k, v, ridge, keys, values, kt, vt, delta, floored, margin, *sizes, **blocks)
    return kt, vt, margin, delta, floored


def buffer_whiten_backward(dkt, dvt, k, keys, values, grad_keys, grad_values, kt, vt, delta, floored, n: int):
    """``∂k``, ``∂v`` and ``∂d`` in the computing dtype; each earlier write's gradient is added into ``grad_keys``
    and ``grad_values``."""
    grid, sizes, blocks = launch(k.shape[0], n, k.shape[1], vt.shape[1], tiles.compute_dtype(k, keys, values, delta))
    dk, dv, dridge = torch.empty_like(kt), torch.empty_like(vt), torch.empty_like(delta)
    args = (k, keys, values, kt, vt, delta, floored, dkt.contiguous(), dvt.contiguous(), dk, dv, dridge)
    _backward[grid](*args, grad_keys, grad_values, *sizes, **blocks)
    return dk, dv, dridge
