"""mHC's Sinkhorn projection as Triton kernels: a tile of tokens per program, each token's n×n matrix in registers
through every iteration.

Forward keeps nothing but the logits for backward. Backward runs the iterations again, writing each step's
normalizers (2·iters vectors of n per token) to a scratch buffer that lives only during the kernel's call, then
walks the steps in reverse: a step ``m' = m / s`` is undone as ``m = m' s``, and its gradient is
``∂m = (∂m' − Σ_axis ∂m' ⊙ m') / s``; at the end ``∂logits = ∂m ⊙ exp(logits − max)``.

The logits may be float64, float32, bfloat16 or float16: they are widened as they are loaded and the iterations
run in ``ACC``, float64 for float64 logits and float32 otherwise; the matrices and the gradient come out in the
logits' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from variants import kernels
from variants.kernels import tiles

BLOCK_ROWS = 16


@triton.jit
def _load_exp(L, rows, R, N, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    oj, ok = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None, None] & (oj < N)[None, :, None] & (ok < N)[None, None, :]
    at = rows[:, None, None] * N * N + oj[None, :, None] * N + ok[None, None, :]
    x = tl.load(L + at, mask=mask, other=float("-inf")).to(ACC)
    top = tl.max(tl.max(x, 2), 1)
    return tl.where(mask, tl.exp(x - top[:, None, None]), 0.0), at, mask


@triton.jit
def _forward(L, M, R, N, ITERS, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row × stride passes 2³¹
    m, at, mask = _load_exp(L, rows, R, N, BLOCK_N, ACC)
    for _ in range(ITERS):
        s = tl.sum(m, 1)  # column sums, (r, k); a padded column sums to 0 and stays 0
        m = m / tl.where(s == 0.0, 1.0, s)[:, None, :]
        s = tl.sum(m, 2)  # row sums, (r, j)
        m = m / tl.where(s == 0.0, 1.0, s)[:, :, None]
    tl.store(M + at, m, mask=mask)


@triton.jit
def _backward(L, DM, DL, SCRATCH, R, N, ITERS, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row × stride passes 2³¹
    on = tl.arange(0, BLOCK_N)
    m, at, mask = _load_exp(L, rows, R, N, BLOCK_N, ACC)
    e = m
    # Each step's normalizers, (r, 2·iters, n) in the scratch buffer, column sums at even steps.
    at_s = rows[:, None] * (2 * ITERS * BLOCK_N) + on[None, :]
    for it in range(ITERS):
        s = tl.sum(m, 1)
        s = tl.where(s == 0.0, 1.0, s)
        tl.store(SCRATCH + at_s + (2 * it) * BLOCK_N, s)
        m = m / s[:, None, :]
        s = tl.sum(m, 2)
        s = tl.where(s == 0.0, 1.0, s)
        tl.store(SCRATCH + at_s + (2 * it + 1) * BLOCK_N, s)
        m = m / s[:, :, None]
    # The normalizers were stored in the sums' layout and are read back in the matrix's: a row's are stored by
    # one warp and loaded by another, which must wait until they are in memory.
    tl.debug_barrier()
    dm = tl.load(DM + at, mask=mask, other=0.0).to(ACC)
    for back in range(ITERS):
        it = ITERS - 1 - back
        s = tl.load(SCRATCH + at_s + (2 * it + 1) * BLOCK_N)  # the row step
        dm = (dm - tl.sum(dm * m, 2)[:, :, None]) / s[:, :, None]
        m = m * s[:, :, None]
        s = tl.load(SCRATCH + at_s + (2 * it) * BLOCK_N)  # the column step
        dm = (dm - tl.sum(dm * m, 1)[:, None, :]) / s[:, None, :]
        m = m * s[:, None, :]
    # m is exp(logits − max) again, to rounding; the undone steps' rounding is why e, not m, multiplies here.
    tl.store(DL + at, dm * e, mask=mask)


def launch(R: int, n: int, acc=tl.float32) -> tuple[tuple[int], dict]:
    """The grid and the tile (constexprs and warps) of both kernels for ``R`` matrices of ``n``×``n``, iterated
    in ``acc``."""
    blocks = dict(BLOCK_R=BLOCK_ROWS, BLOCK_N=max(2, triton.next_power_of_2(n)), num_warps=tiles.WARPS, ACC=acc)
    return (triton.cdiv(R, BLOCK_ROWS),), blocks


@torch.library.custom_op("depthmem::sinkhorn", mutates_args=())
def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """``naive.sinkhorn`` by the forward kernel."""
    R, n, _ = logits.shape
    grid, blocks = launch(R, n, tiles.compute_dtype(logits))
    m = torch.empty_like(logits)
    _forward[grid](logits, m, R, n, iters, **blocks)
    return m


@sinkhorn.register_fake
def _(logits, iters):
    return torch.empty_like(logits)


@torch.library.custom_op("depthmem::sinkhorn_backward", mutates_args=())
def sinkhorn_backward(dm: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor:
    R, n, _ = logits.shape
    grid, blocks = launch(R, n, tiles.compute_dtype(logits))
    acc = kernels.compute_dtype(logits)
    scratch = logits.new_empty(grid[0] * blocks["BLOCK_R"], 2 * iters, blocks["BLOCK_N"], dtype=acc)
    dl = torch.empty_like(logits)
    _backward[grid](logits, dm.contiguous(), dl, scratch, R, n, iters, **blocks)
    return dl


@sinkhorn_backward.register_fake
def _(dm, logits, iters):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, ctx.iters = inputs
    ctx.save_for_backward(logits)


def _grad(ctx, dm):
    (logits,) = ctx.saved_tensors
    return sinkhorn_backward(dm, logits, ctx.iters), None


sinkhorn.register_autograd(_grad, setup_context=_setup)
