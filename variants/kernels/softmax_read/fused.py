"""AttnRes's depth read as Triton kernels: a tile of rows per program streams each source once.

Forward: per source ``ρ_s = (mean(v_s²) + ε)^{-1/2}`` and the logit ``z_s = ρ_s w·v_s`` in the same pass as the
weighted sum, by an online softmax (the running maximum rescales what was summed so far); it saves only the
log-sum-exp per row. Backward recomputes ``p_s = exp(z_s − lse)`` in one pass and, with ``δ = aᵀ∂a``,
``∂z_s = p_s (v_sᵀ∂a − δ)``:

    ∂v_s = p_s ∂a + ∂z_s (ρ_s w − (w·v_s) ρ_s³ v_s / d),   ∂w = Σ_rows Σ_s ∂z_s ρ_s v_s

the last summed per program into a (programs, d) buffer and over programs outside the kernel.

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
def _forward(V, W, A, LSE, R, S, D, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row × stride passes 2³¹
    od = tl.arange(0, BLOCK_D)
    rmask = rows < R
    mask = rmask[:, None] & (od < D)[None, :]
    w = tl.load(W + od, mask=od < D, other=0.0).to(ACC)
    big = tl.zeros([BLOCK_R], dtype=ACC) - float("inf")
    total = tl.zeros([BLOCK_R], dtype=ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
    for s in range(S):
        v = tl.load(V + (rows[:, None] * S + s) * D + od[None, :], mask=mask, other=0.0).to(ACC)
        rho = 1.0 / tl.sqrt(tl.sum(v * v, 1) / D + eps)
        z = rho * tl.sum(v * w[None, :], 1)
        new = tl.maximum(big, z)
        scale, p = tl.exp(big - new), tl.exp(z - new)
        total = total * scale + p
        acc = acc * scale[:, None] + p[:, None] * v
        big = new
    tl.store(A + rows[:, None] * D + od[None, :], acc / total[:, None], mask=mask)
    tl.store(LSE + rows, big + tl.log(total), mask=rmask)


@triton.jit
def _backward(V, W, A, LSE, DA, DV, DW, R, S, D, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
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
    for s in range(S):
        at = (rows[:, None] * S + s) * D + od[None, :]
        v = tl.load(V + at, mask=mask, other=0.0).to(ACC)
        rho = 1.0 / tl.sqrt(tl.sum(v * v, 1) / D + eps)
        wv = tl.sum(v * w[None, :], 1)
        p = tl.where(rmask, tl.exp(rho * wv - lse), 0.0)
        dz = p * (tl.sum(v * da, 1) - delta)
        dlogit_dv = rho[:, None] * w[None, :] - (wv * rho * rho * rho / D)[:, None] * v
        tl.store(DV + at, p[:, None] * da + dz[:, None] * dlogit_dv, mask=mask)
        dw += tl.sum((dz * rho)[:, None] * v, 0)
    tl.store(DW + pid * D + od, dw, mask=od < D)


def launch(R: int, D: int, acc=tl.float32) -> tuple[tuple[int], dict]:
    """The grid and the tile (constexprs and warps) of both kernels for ``R`` rows of width ``D``, computed in
    ``acc``."""
    block = triton.next_power_of_2(D)
    # A whole model width per row: more warps share it at GPT-2 widths than the default four, so that a program
    # takes two rows (the fewer rows, the larger the per-program partial sums of ∂w that backward writes).
    warps = 2 * tiles.WARPS if block >= 1024 else tiles.WARPS
    rows = tiles.rows_per_program(block, PER_THREAD, warps)
    return (triton.cdiv(R, rows),), dict(BLOCK_R=rows, BLOCK_D=block, num_warps=warps, ACC=acc)


def _outputs(values, query):
    """Empty read and log-sum-exp for these inputs, both in the dtype the kernel computes in: backward reads the
    read again, which must not carry a bfloat16 rounding into the gradients."""
    R, _, D = values.shape
    acc = kernels.compute_dtype(values, query)
    return values.new_empty(R, D, dtype=acc), values.new_empty(R, dtype=acc)


@torch.library.custom_op("depthmem::softmax_read", mutates_args=())
def softmax_read(values: torch.Tensor, query: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``naive.softmax_read`` by the forward kernel, and the log-sum-exp of each row's logits."""
    R, S, D = values.shape
    grid, blocks = launch(R, D, tiles.compute_dtype(values, query))
    a, lse = _outputs(values, query)
    _forward[grid](values, query, a, lse, R, S, D, eps, **blocks)
    return a, lse


@softmax_read.register_fake
def _(values, query, eps):
    return _outputs(values, query)


@torch.library.custom_op("depthmem::softmax_read_backward", mutates_args=())
def softmax_read_backward(
    da: torch.Tensor, values: torch.Tensor, query: torch.Tensor, a: torch.Tensor, lse: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    R, S, D = values.shape
    grid, blocks = launch(R, D, tiles.compute_dtype(values, query))
    dv, dw = torch.empty_like(values), lse.new_empty(grid[0], D)
    _backward[grid](values, query, a, lse, da.contiguous(), dv, dw, R, S, D, eps, **blocks)
    return dv, dw.sum(0).to(query.dtype)


@softmax_read_backward.register_fake
def _(da, values, query, a, lse, eps):
    return torch.empty_like(values), query.new_empty(query.shape)


def _setup(ctx, inputs, output):
    values, query, ctx.eps = inputs
    ctx.save_for_backward(values, query, *output)


def _grad(ctx, da, _):
    values, query, a, lse = ctx.saved_tensors
    dv, dw = softmax_read_backward(da, values, query, a, lse, ctx.eps)
    return dv, dw, None


softmax_read.register_autograd(_grad, setup_context=_setup)
