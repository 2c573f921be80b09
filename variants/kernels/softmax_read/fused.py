"""AttnRes's depth read as Triton kernels: a tile of rows per program streams each source once.

The sources are a depth buffer's first ``n`` writes, depth-major (capacity, R, d) (``variants/kernels/buffer.py``),
and, with ``EXTRA``, one more source (R, d) outside it: block AttnRes's partial sum of the current block, which
changes at every layer and so is never written.

Forward: per source ``ρ_s = (mean(v_s²) + ε)^{-1/2}`` and the logit ``z_s = ρ_s w·v_s`` in the same pass as the
weighted sum, by an online softmax (the running maximum rescales what was summed so far); it saves only the
log-sum-exp per row. Backward recomputes ``p_s = exp(z_s − lse)`` in one pass and, with ``δ = aᵀ∂a``,
``∂z_s = p_s (v_sᵀ∂a − δ)``:

    ∂v_s = p_s ∂a + ∂z_s (ρ_s w − (w·v_s) ρ_s³ v_s / d),   ∂w = Σ_rows Σ_s ∂z_s ρ_s v_s

each ``∂v_s`` added into the buffer's float32 gradient in place (a row's slots are its program's alone), the extra
source's stored, and ``∂w`` summed per program into a (programs, d) buffer and over programs outside the kernel.

The sources and the query may be float64, float32, bfloat16 or float16, each its own (the sources kept in
bfloat16, say): they are widened as they are loaded and the arithmetic is in ``ACC``, float64 where an input is
float64 and float32 otherwise; the read and the log-sum-exp come out in ``ACC`` (the caller casts the read), each
gradient in its input's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from variants import kernels
from variants.kernels import tiles

PER_THREAD = 8  # elements of each (rows, width) tile per thread: two rows of a GPT-2 width at eight warps


@triton.jit
def _attend(v, w, big, total, acc, D, eps):
    """One source into the online softmax: the running maximum, the sum of weights and the weighted sum."""
    rho = 1.0 / tl.sqrt(tl.sum(v * v, 1) / D + eps)
    z = rho * tl.sum(v * w[None, :], 1)
    new = tl.maximum(big, z)
    scale, p = tl.exp(big - new), tl.exp(z - new)
    return new, total * scale + p, acc * scale[:, None] + p[:, None] * v


@triton.jit
def _forward(
    V, X, W, A, LSE, R, n, D, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, EXTRA: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row × stride passes 2³¹
    od = tl.arange(0, BLOCK_D)
    rmask = rows < R
    mask = rmask[:, None] & (od < D)[None, :]
    w = tl.load(W + od, mask=od < D, other=0.0).to(ACC)
    big = tl.zeros([BLOCK_R], dtype=ACC) - float("inf")
    total = tl.zeros([BLOCK_R], dtype=ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
    for s in range(n):
        v = tl.load(V + (s * R + rows[:, None]) * D + od[None, :], mask=mask, other=0.0).to(ACC)
        big, total, acc = _attend(v, w, big, total, acc, D, eps)
    if EXTRA:
        v = tl.load(X + rows[:, None] * D + od[None, :], mask=mask, other=0.0).to(ACC)
        big, total, acc = _attend(v, w, big, total, acc, D, eps)
    tl.store(A + rows[:, None] * D + od[None, :], acc / total[:, None], mask=mask)
    tl.store(LSE + rows, big + tl.log(total), mask=rmask)


@triton.jit
def _source_grad(v, w, da, delta, lse, rmask, D, eps):
    """A source's gradient and its term of ``∂w`` (before the sum over rows)."""
    rho = 1.0 / tl.sqrt(tl.sum(v * v, 1) / D + eps)
    wv = tl.sum(v * w[None, :], 1)
    p = tl.where(rmask, tl.exp(rho * wv - lse), 0.0)
    dz = p * (tl.sum(v * da, 1) - delta)
    dlogit_dv = rho[:, None] * w[None, :] - (wv * rho * rho * rho / D)[:, None] * v
    return p[:, None] * da + dz[:, None] * dlogit_dv, (dz * rho)[:, None] * v


@triton.jit
def _backward(
    V, X, W, A, LSE, DA, DV, DX, DW, R, n, D, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, EXTRA: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row × stride passes 2³¹
    od = tl.arange(0, BLOCK_D)
    rmask = rows < R
    mask = rmask[:, None] & (od < D)[None, :]
    w = tl.load(W + od, mask=od < D, other=0.0).to(ACC)
    a = tl.load(A + rows[:, None] * D + od[None, :], mask=mask, other=0.0).to(ACC)
    da = tl.load(DA + rows[:, None] * D + od[None, :], mask=mask, other=0.0).to(ACC)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    delta = tl.sum(a * da, 1)
    dw = tl.zeros([BLOCK_D], dtype=ACC)
    for s in range(n):
        at = (s * R + rows[:, None]) * D + od[None, :]
        v = tl.load(V + at, mask=mask, other=0.0).to(ACC)
        dv, dwv = _source_grad(v, w, da, delta, lse, rmask, D, eps)
        # This row's own slot: no other program touches it.
        dv += tl.load(DV + at, mask=mask, other=0.0).to(ACC)
        tl.store(DV + at, dv, mask=mask)
        dw += tl.sum(dwv, 0)
    if EXTRA:
        at = rows[:, None] * D + od[None, :]
        v = tl.load(X + at, mask=mask, other=0.0).to(ACC)
        dv, dwv = _source_grad(v, w, da, delta, lse, rmask, D, eps)
        tl.store(DX + at, dv, mask=mask)
        dw += tl.sum(dwv, 0)
    tl.store(DW + pid * D + od, dw, mask=od < D)


def launch(R: int, D: int, acc=tl.float32, extra: bool = False) -> tuple[tuple[int], dict]:
    """The grid and the tile (constexprs and warps) of both kernels for ``R`` rows of width ``D``, computed in
    ``acc``, with or without an ``extra`` source."""
    block = triton.next_power_of_2(D)
    # A whole model width per row: more warps share it at GPT-2 widths than the default four, so that a program
    # takes two rows (the fewer rows, the larger the per-program partial sums of ∂w that backward writes).
    warps = 2 * tiles.WARPS if block >= 1024 else tiles.WARPS
    rows = tiles.rows_per_program(block, PER_THREAD, warps)
    return (triton.cdiv(R, rows),), dict(BLOCK_R=rows, BLOCK_D=block, num_warps=warps, ACC=acc, EXTRA=extra)


def _inputs(query, values, extra):
    """The grid, the tile, the extra source's pointer, R, D and the computing dtype of a launch."""
    tensors = (values, query) if extra is None else (values, query, extra)
    R, D = values.shape[1:]
    grid, blocks = launch(R, D, tiles.compute_dtype(*tensors), extra is not None)
    # Without an extra source the kernels never load it: any pointer stands in.
    return grid, blocks, values if extra is None else extra.contiguous(), R, D, kernels.compute_dtype(*tensors)


def buffer_read(query, values, n: int, extra, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The read over ``values[:n]`` (and ``extra``) and the log-sum-exp of each row's logits, both in the dtype the
    kernel computes in: backward reads the read again, which must not carry a bfloat16 rounding into the
    gradients."""
    grid, blocks, x, R, D, acc = _inputs(query, values, extra)
    a, lse = values.new_empty(R, D, dtype=acc), values.new_empty(R, dtype=acc)
    _forward[grid](values, x, query, a, lse, R, n, D, eps, **blocks)
    return a, lse


def buffer_read_backward(da, query, values, grad_values, n: int, extra, a, lse, eps: float):
    """``∂w`` and the extra source's gradient (an empty tensor without one), with each ``∂v_s`` added into
    ``grad_values`` in place."""
    grid, blocks, x, R, D, _ = _inputs(query, values, extra)
    dx = torch.empty_like(x) if extra is not None else query.new_empty(0)
    dw = lse.new_empty(grid[0], D)
    _backward[grid](values, x, query, a, lse, da.contiguous(), grad_values, dx, dw, R, n, D, eps, **blocks)
    return dw.sum(0).to(query.dtype), dx
