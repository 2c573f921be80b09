"""LDM's depth buffer (variants/kernels/buffer.py, read by variants/kernels/depth_read/buffer.py): writes stored
once, reads in place, gradients summed in place, against the same chain of reads over stacked writes run by
autograd in float64.

Each chain interleaves writes and reads as a model does: write ``i`` is a function of the reads before it, so a
gradient reaches it through every later read and through the write itself. The reference stacks the writes for every
read and lets autograd sum their gradients, the form the buffer replaces.
"""

from __future__ import annotations

import pytest
import torch
from dispatched_outputs import DispatchedOutputs

from variants import kernels
from variants.kernels.buffer import DepthBuffer
from variants.kernels.depth_read import naive
from variants.kernels.depth_read.buffer import buffer_read

MODES = ["off", pytest.param("on", marks=pytest.mark.skipif(not kernels.TRITON, reason="needs Triton"))]


class _Chain(torch.nn.Module):
    """``L`` writes and the reads between them: write ``i`` is ``tanh`` of the latest stream through its own
    projection, the stream adds each read; the last read takes every write, as a model's head does. The writes are
    stored in ``dtype``, the stream and the reads run in ``stream``."""

    def __init__(self, L: int, rows: int, key: int, value: int, dtype: torch.dtype, stream: torch.dtype | None = None):
        super().__init__()
        self.L, self.key = L, key
        self.x = torch.nn.Parameter(torch.randn(rows, key, dtype=torch.float64))
        self.w = torch.nn.Parameter(torch.randn(L, key, key + value, dtype=torch.float64) / key**0.5)
        self.back = torch.nn.Parameter(torch.randn(value, key, dtype=torch.float64) / value**0.5)
        self.dtype, self.stream = dtype, stream or torch.promote_types(dtype, torch.float32)

    def forward(self, stacked: bool):
        h = self.x.to(self.stream)
        buffer, keys, values, reads = None, [], [], []
        for i in range(self.L):
            kv = torch.tanh(h @ self.w[i].to(h.dtype))
            k = torch.nn.functional.normalize(kv[:, : self.key], dim=-1).to(self.dtype)
            v = kv[:, self.key :].to(self.dtype)
            if stacked:
                keys.append(k.to(h.dtype))
                values.append(v.to(h.dtype))
                m = naive.depth_read(h, torch.stack(keys, 1), torch.stack(values, 1))
            else:
                buffer = (buffer or DepthBuffer.allocate(self.L, k, v)).append(k, v)
                m = buffer_read(buffer, h)
            reads.append(m)
            h = h + torch.tanh(m) @ self.back.to(h.dtype)
        return h, reads


def _grads(model, stacked, loss):
    model.zero_grad()
    h, reads = model(stacked)
    loss(h, reads).backward()
    return h.detach(), [p.grad.clone() for p in model.parameters()]


def _relative(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("L,rows,key,value", [(1, 3, 2, 3), (5, 37, 7, 11), (9, 20, 16, 5)])
def test_reads_and_gradients_equal_the_stacked_reads(rng_seed, mode, L, rows, key, value):
    """In float64, to rounding: the buffer and its token chain give every read and every gradient of a chain whose
    writes depend on the reads before them."""
    model = _Chain(L, rows, key, value, torch.float64)

    def loss(h, reads):
        return h.square().sum()

    with kernels.mode(mode):
        got = _grads(model, False, loss)
    want = _grads(model, True, loss)
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert _relative(g, w) < 1e-12


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_in_low_precision_and_summed_in_float32(rng_seed, mode, dtype):
    """Writes stored in float32 or bfloat16 and read by float32 queries, against the same stored values read in
    float64: reads and gradients within float32's rounding where the writes are float32 and within one bfloat16
    unit where the gradient a write receives is rounded to bfloat16. The writes do not depend on the reads here,
    so both sides store the very same values."""
    L, rows, key, value = 12, 33, 16, 24
    sources = torch.randn(L, rows, key + value, dtype=torch.float64, requires_grad=True)
    queries = torch.randn(L, rows, key, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(L, rows, value, dtype=torch.float64)

    def run(stacked, precision):
        buffer, keys, values, reads = None, [], [], []
        for i in range(L):
            k = torch.nn.functional.normalize(sources[i, :, :key], dim=-1).to(dtype)
            v = sources[i, :, key:].to(dtype)
            q = queries[i].to(precision)
            if stacked:
                keys.append(k.to(precision))
                values.append(v.to(precision))
                m = naive.depth_read(q, torch.stack(keys, 1), torch.stack(values, 1))
            else:
                buffer = (buffer or DepthBuffer.allocate(L, k, v)).append(k, v)
                m = buffer_read(buffer, q)
            reads.append(m.double())
        reads = torch.stack(reads)
        return [reads.detach(), *torch.autograd.grad(reads, (sources, queries), weights)]

    with kernels.mode(mode):
        got = run(False, torch.float32)
    want = run(True, torch.float64)
    bound = 1e-5 if dtype == torch.float32 else torch.finfo(torch.bfloat16).eps
    for g, w in zip(got, want):
        assert _relative(g, w) < bound


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_on_early_reads_alone_reaches_only_the_writes_they_read(rng_seed, mode):
    """Autograd runs only the backward of the reads the loss depends on; each write gets the gradient of those."""
    model = _Chain(6, 13, 5, 4, torch.float64)

    def loss(h, reads):
        return reads[1].square().sum() + (reads[3] * 0.5).sum()

    with kernels.mode(mode):
        _, grads = _grads(model, False, loss)
    _, grads_ref = _grads(model, True, loss)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = grads_ref[1]  # the writes' projections: those after the last read the loss takes get nothing
    assert float(w[4:].abs().max()) == 0 and float(w[:4].abs().amax((1, 2)).min()) > 0


def test_writes_without_gradients_and_reads_without_autograd(rng_seed):
    k, v, q = torch.randn(6, 3), torch.randn(6, 4), torch.randn(6, 3, requires_grad=True)
    with torch.no_grad():
        buffer = DepthBuffer.allocate(2, k, v).append(k, v)
        assert buffer.token is None
        torch.testing.assert_close(buffer_read(buffer, q), naive.depth_read(q, k[:, None], v[:, None]))
    # keys that need no gradient: the reads' backward still reaches q
    buffer = DepthBuffer.allocate(2, k, v).append(k, v)
    assert buffer.token is None
    (g,) = torch.autograd.grad(buffer_read(buffer, q).sum(), q)
    torch.testing.assert_close(g, v.sum(-1, keepdim=True) * k)
    keys, values = buffer.written()
    assert len(keys) == 1 and torch.equal(keys[0], k) and torch.equal(values[0], v)


def _backward_elements(L: int, stacked: bool) -> int:
    model = _Chain(L, 64, 8, 8, torch.float32)
    h, _ = model(stacked)
    with DispatchedOutputs() as seen:
        h.square().sum().backward()
    return seen.elements


def test_backward_traffic_grows_like_the_writes_not_their_square(rng_seed):
    """Outside the read kernels' own passes, a step's backward moves O(L) tensors: doubling the depth doubles it.
    The stacked reads hand autograd a gradient per read and write, O(L²): the same count grows about fourfold."""
    buffered = _backward_elements(16, False) / _backward_elements(8, False)
    stacked = _backward_elements(16, True) / _backward_elements(8, True)
    assert buffered < 2.3 < 3.0 < stacked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_read_holds_one_write_at_a_time(rng_seed, dtype):
    """The plain read and its backward take the writes one at a time, bf16 ones widened to float32 one at a time:
    over 16 writes of the same buffer they peak within one write's float32 of a read over 4. Products over all the
    writes at once, as the read had, hold (n, R, ·) temporaries: 7 writes' more in the float32 backward at 16 and
    3.5 more in the bf16 forward."""
    from harness.measure import AllocatorPeak
    from variants.kernels.depth_read.buffer import read, read_backward

    R, key, value, capacity = 256, 64, 48, 16
    keys = torch.nn.functional.normalize(torch.randn(capacity, R, key), dim=-1).to(dtype)
    values = torch.randn(capacity, R, value).to(dtype)
    grad_keys, grad_values = torch.zeros(keys.shape), torch.zeros(values.shape)  # a buffer's float32 gradient
    q, dm = torch.randn(R, key).to(dtype), torch.randn(R, value).to(dtype)

    def peaks(n: int) -> tuple[int, int]:
        meter = AllocatorPeak("cpu")
        meter.start()
        read(q, keys, values, n, None)
        forward = meter.stop()
        meter.start()
        read_backward(dm, q, keys, values, grad_keys, grad_values, n, False)
        return forward, meter.stop()

    with kernels.mode("off"):
        (few_forward, few_backward), (many_forward, many_backward) = peaks(4), peaks(16)
    write = R * (key + value) * 4
    assert many_forward - few_forward < write and many_backward - few_backward < write
