"""AttnRes's and DenseFormer's depth buffers (variants/kernels/buffer.py, read by softmax_read/buffer.py and
weighted_read.py): sources stored once, reads in place, gradients summed in place, against the same chain of reads
over stacked sources run by autograd in float64.

Each chain interleaves writes and reads as a model does: source ``i`` is a function of the reads before it, so a
gradient reaches it through every later read and through the source itself. The reference stacks the sources for
every read and lets autograd sum their gradients, the form the buffers replace.
"""

from __future__ import annotations

import pytest
import torch
from dispatched_outputs import DispatchedOutputs

from variants import kernels
from variants.kernels import softmax_read, weighted_read
from variants.kernels.buffer import DepthBuffer
from variants.kernels.softmax_read import naive

MODES = ["off", pytest.param("on", marks=pytest.mark.skipif(not kernels.TRITON, reason="needs Triton"))]
EPS = softmax_read.buffer.EPS


class _Chain(torch.nn.Module):
    """``L`` sources and the reads between them. Source ``i`` is ``tanh`` of the latest stream through its own
    projection; read ``i`` is a softmax read with its own query (``"softmax"``, AttnRes), over the sources so far
    and, with ``partial``, the sum of the sources since the last even one beside them (block AttnRes's partial sum
    of a block of two), or a weighted average with its own weights (``"weighted"``, DenseFormer); the stream adds
    each read."""

    def __init__(self, L: int, rows: int, width: int, read: str, partial: bool = False, dtype=torch.float64):
        super().__init__()
        self.L, self.read, self.partial, self.dtype = L, read, partial, dtype
        self.x = torch.nn.Parameter(torch.randn(rows, width, dtype=torch.float64))
        # One parameter per layer, as the models hold them: a slice of a stacked one would hand autograd a
        # gradient of the whole stack per layer, O(L²) traffic of the chain's own.
        params = torch.nn.ParameterList
        self.w = params(torch.randn(width, width, dtype=torch.float64) / width**0.5 for _ in range(L))
        self.q = params(torch.randn(width, dtype=torch.float64) for _ in range(L))
        self.alpha = params(torch.randn(i + 2, dtype=torch.float64) for i in range(L))
        self.back = torch.nn.Parameter(torch.randn(width, width, dtype=torch.float64) / width**0.5)

    def forward(self, stacked: bool):
        h = self.x
        first = h.to(self.dtype)
        buffer, written, partial, reads = DepthBuffer.allocate(self.L + 1, first).append(first), [first], None, []
        for i in range(self.L):
            out = torch.tanh(h @ self.w[i])
            if self.partial and i % 2:  # the second of a block: the block completes with it
                out, partial = partial + out, None
                source = out
            elif self.partial:
                partial, source = out, None
            else:
                source = out
            if source is not None:
                written.append(source.to(self.dtype))
                buffer = buffer.append(source.to(self.dtype))
            reads.append(self._read(buffer, written, partial, i, stacked))
            h = h + torch.tanh(reads[-1]) @ self.back
        return h, reads

    def _read(self, buffer, written, partial, i, stacked):
        if self.read == "weighted":
            alpha = self.alpha[i][: buffer.n]
            if stacked:
                return (torch.stack(written, -1) * alpha.to(self.x.dtype)).sum(-1)
            return weighted_read.buffer_read(buffer, alpha)
        if stacked:
            sources = written + ([partial] if partial is not None else [])
            return naive.softmax_read(torch.stack(sources, 1).to(self.x.dtype), self.q[i], EPS)
        return softmax_read.buffer_read(buffer, self.q[i], partial)


def _grads(model, stacked, loss):
    model.zero_grad()
    h, reads = model(stacked)
    loss(h, reads).backward()
    return [h.detach()] + [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _relative(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


CHAINS = [("softmax", False), ("softmax", True), ("weighted", False)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("read,partial", CHAINS, ids=["attnres", "attnres-block", "denseformer"])
@pytest.mark.parametrize("L,rows,width", [(1, 3, 2), (6, 37, 11), (9, 20, 64)])
def test_reads_and_gradients_equal_the_stacked_reads(rng_seed, mode, read, partial, L, rows, width):
    """In float64, to rounding: the buffer and its token chain give every read and every gradient of a chain whose
    sources depend on the reads before them."""
    model = _Chain(L, rows, width, read, partial)

    def loss(h, reads):
        return h.square().sum()

    with kernels.mode(mode):
        got = _grads(model, False, loss)
    want = _grads(model, True, loss)
    for g, w in zip(got, want, strict=True):
        assert _relative(g, w) < 1e-12


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("read,partial", CHAINS, ids=["attnres", "attnres-block", "denseformer"])
def test_a_loss_on_early_reads_alone_reaches_only_the_sources_they_read(rng_seed, mode, read, partial):
    """Autograd runs only the backward of the reads the loss depends on; each source gets the gradient of those."""
    model = _Chain(6, 13, 8, read, partial)

    def loss(h, reads):
        return reads[1].square().sum() + (reads[3] * 0.5).sum()

    with kernels.mode(mode):
        got = _grads(model, False, loss)
    want = _grads(model, True, loss)
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    # The sources' projections: those after the last read the loss takes get nothing.
    w = [g for (name, _), g in zip(model.named_parameters(), want[1:]) if name.startswith("w.")]
    assert [float(g.abs().max()) > 0 for g in w] == [True] * 4 + [False] * 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extra", [False, True], ids=["buffer", "float32 extra"])
def test_sources_stored_in_bfloat16_read_in_float32(rng_seed, mode, extra):
    """Sources stored in bfloat16 and read by a float32 query, against the very same stored values read in float64:
    reads and gradients within one bfloat16 unit (a source's gradient is rounded to its dtype once). With ``extra``
    a float32 source is read beside them, as AttnRes reads its embedding beside the sublayers' bf16 outputs."""
    L, rows, width = 10, 33, 40
    sources = (torch.randn(L, rows, width, dtype=torch.float64) * 3).requires_grad_()
    queries = torch.randn(L, width, dtype=torch.float64, requires_grad=True)
    embedding = (torch.randn(rows, width, dtype=torch.float64) * 3).float().double().requires_grad_()
    weights = torch.randn(L, rows, width, dtype=torch.float64)

    def run(stacked):
        buffer, written, reads = None, [], []
        x = embedding if extra else None
        for i in range(L):
            v = sources[i].bfloat16()
            if stacked:
                written.append(v.double())
                stack = torch.stack(written + ([x] if extra else []), 1)
                reads.append(naive.softmax_read(stack, queries[i], EPS))
            else:
                buffer = (buffer or DepthBuffer.allocate(L, v)).append(v)
                x32 = x.float() if extra else None
                reads.append(softmax_read.buffer_read(buffer, queries[i].float(), x32).double())
        reads = torch.stack(reads)
        inputs = (sources, queries, embedding)
        return [reads.detach(), *torch.autograd.grad(reads, inputs, weights, allow_unused=True, materialize_grads=True)]

    with kernels.mode(mode):
        got = run(False)
    want = run(True)
    for g, w in zip(got, want):
        assert _relative(g, w) < torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("mode", MODES)
def test_attnres_keeps_the_bf16_outputs_as_they_came_and_reads_its_embedding_in_float32(rng_seed, mode, monkeypatch):
    """Under bf16 autocast AttnRes's buffer holds the sublayers' bf16 outputs, half the bytes of float32, and the
    float32 embedding is read beside it: the logits and every gradient equal those of the same model with all its
    sources held in float32, since the outputs have no more digits to keep and the embedding keeps all of its."""
    from harness import build_model, model_preset

    model = build_model(model_preset("tiny", n_blocks=3), "attnres")
    with torch.no_grad():
        model.mixer.queries.normal_()  # weights far from the uniform ones of the zero initialisation
    idx, targets = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    allocate = DepthBuffer.allocate.__func__

    def run(widen: bool):
        stored = []

        def recording(cls, capacity, *writes):
            stored.append(writes[0].dtype)
            return allocate(cls, capacity, *(w.float() if widen else w for w in writes))

        monkeypatch.setattr(DepthBuffer, "allocate", classmethod(recording))
        model.zero_grad()
        with kernels.mode(mode), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        return stored, [logits.detach()] + [p.grad.clone() for p in model.parameters()]

    stored, got = run(widen=False)
    assert stored == [torch.bfloat16]
    _, want = run(widen=True)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_weights_of_a_read_are_its_softmax(rng_seed):
    with torch.no_grad():
        values = torch.randn(3, 9, 16, dtype=torch.float64)
        extra, q = torch.randn(9, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
        buffer = DepthBuffer.allocate(4, values[0])
        for v in values:
            buffer = buffer.append(v)
        stacked = torch.cat([values, extra[None]]).transpose(0, 1)  # (R, S, d)
        rho = torch.rsqrt(stacked.square().mean(-1) + EPS)
        torch.testing.assert_close(softmax_read.weights(buffer, q, extra), torch.softmax(rho * (stacked @ q), -1))
        assert buffer.token is None


def test_a_full_buffer_and_mismatched_weights_are_refused(rng_seed):
    v = torch.randn(5, 3)
    buffer = DepthBuffer.allocate(1, v).append(v)
    with pytest.raises(ValueError, match="a depth buffer of 1 writes is full"):
        buffer.append(v)
    with pytest.raises(ValueError, match="2 weights for 1 sources"):
        weighted_read.buffer_read(buffer, torch.randn(2))


def _backward_elements(L: int, read: str, stacked: bool) -> int:
    model = _Chain(L, 64, 16, read, dtype=torch.float32).float()
    h, _ = model(stacked)
    with DispatchedOutputs() as seen:
        h.square().sum().backward()
    return seen.elements


@pytest.mark.parametrize("read", ["softmax", "weighted"])
def test_backward_traffic_grows_like_the_sources_not_their_square(rng_seed, read):
    """Outside the reads' own passes, a step's backward moves O(L) tensors: doubling the depth doubles it. The
    stacked reads hand autograd a gradient per read and source, O(L²): the same count grows over threefold (the
    chain's O(L) share keeps it from four). Measured: 1.92 against 3.27 (softmax), 1.92 against 3.01 (weighted)."""
    buffered = _backward_elements(16, read, False) / _backward_elements(8, read, False)
    stacked = _backward_elements(16, read, True) / _backward_elements(8, read, True)
    assert buffered < 2.1 < 2.8 < stacked


@pytest.mark.parametrize("extra", [False, True], ids=["buffer", "float32 extra"])
def test_bf16_sources_are_widened_one_at_a_time(rng_seed, extra):
    """The plain read and its backward widen bf16 sources to float32 one source at a time: over 16 sources of the
    same buffer they peak within one source's float32 of a read over 4. Widening all of them at once, as a list of
    casts does, holds them all: twelve sources' more at 16."""
    from harness.measure import AllocatorPeak

    R, d, capacity = 256, 64, 16
    written = torch.randn(capacity, R, d).bfloat16()
    values, grad_values = written.clone(), torch.zeros(capacity, R, d)
    query, da = torch.randn(d), torch.randn(R, d)
    x = torch.randn(R, d) if extra else None

    def peaks(n: int) -> tuple[int, int]:
        meter = AllocatorPeak("cpu")
        meter.start()
        a, lse = softmax_read.buffer.read(query, values, n, None, x, EPS)
        forward = meter.stop()
        meter.start()
        softmax_read.buffer.read_backward(da, query, values, grad_values, n, x, a, lse, EPS, False)
        return forward, meter.stop()

    with kernels.mode("off"):
        (few_forward, few_backward), (many_forward, many_backward) = peaks(4), peaks(16)
    source = R * d * 4
    assert many_forward - few_forward < source and many_backward - few_backward < source


@pytest.mark.parametrize("read,partial", CHAINS, ids=["attnres", "attnres-block", "denseformer"])
def test_a_second_backward_through_the_same_graph_gives_the_same_gradients(rng_seed, read, partial):
    """Each write's link zeroes its slot of the buffer's gradient once it has taken it, so a graph kept for a second
    backward (``retain_graph=True``) sums from zero again rather than on top of the first."""
    model = _Chain(5, 7, 8, read, partial)
    h, _ = model(False)
    loss = h.square().sum()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for a, b in zip(first, second, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("spec", ["ldm", "ldm-rls", "attnres", "attnres-block", "denseformer"])
def test_a_model_backward_twice_through_the_same_graph_gives_the_same_gradients(rng_seed, spec):
    from harness import build_model, model_preset

    cfg = model_preset("tiny")
    model = build_model(cfg, spec)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = model(idx).square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    first = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(loss, params, allow_unused=True)
    for a, b in zip(first, second, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
