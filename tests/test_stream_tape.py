"""HC and mHC keep their ``n·d`` stream for backward at every ``segment``-th layer only (``variants/ops/tape.py``).

The recomputed streams must be the forward's to the bit, whatever the segment, and what autograd saves must
shrink by exactly the streams not kept, without a reference cycle that would hold a step's memory past its
backward (or past a forward that never had one).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from harness import build_model, model_preset
from harness.benchmarks.memory import cpu_peak_allocated_bytes, saved_activation_bytes
from variants.ops import tape as tape_module

SPECS = ["hc", "hc(dynamic=off)", "mhc", "mhc(expansion=3,sinkhorn_iters=4)"]


def _model(spec: str, n_blocks: int = 5):
    model = build_model(model_preset("tiny", n_blocks=n_blocks), spec)
    with torch.no_grad():  # away from the initialization, where several connections are exactly trivial
        for p in model.mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _loss_and_grads(model, idx, targets, *, segment, backward_twice=False):
    model.mixer.stream_segment = segment
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward(retain_graph=backward_twice)
    if backward_twice:  # the tape must recompute a segment it has already dropped
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_every_segment_length_gives_the_forward_and_gradients_of_keeping_every_stream(spec, rng_seed):
    model = _model(spec)  # L = 10 layers
    idx, targets = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    assert model.mixer.segment() == 4  # the default: ⌈√10⌉ for the streams X_0..X_9
    want_loss, want = _loss_and_grads(model, idx, targets, segment=1)
    for segment in (2, 3, None, 7, 10, 25):
        loss, got = _loss_and_grads(model, idx, targets, segment=segment)
        assert torch.equal(loss, want_loss), segment
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"segment {segment}"
    # Backward twice over one graph, and under a hook of the caller's (here: saved tensors moved to host memory).
    _, twice = _loss_and_grads(model, idx, targets, segment=3, backward_twice=True)
    for g, w in zip(twice, want):
        torch.testing.assert_close(g, 2 * w, rtol=1e-6, atol=1e-7)
    with torch.autograd.graph.save_on_cpu():
        _, hooked = _loss_and_grads(model, idx, targets, segment=3)
    assert all(torch.equal(g, w) for g, w in zip(hooked, want))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["hc", "mhc"])
def test_autograd_saves_only_the_kept_streams(spec, rng_seed):
    model = _model(spec)
    b, t = 2, 16
    idx, targets = torch.randint(0, 512, (b, t)), torch.randint(0, 512, (b, t))
    stream_bytes = b * t * model.mixer.n * model.cfg.d_model * 4

    def saved(segment):
        model.mixer.stream_segment = segment
        with saved_activation_bytes(exclude=list(model.parameters())) as counted:
            F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
        return counted["bytes"]

    every = saved(1)
    # L = 10, segments of 4: the streams before layers 0, 4 and 8 are kept, the other 7 recomputed. The count
    # goes through the tape's hooks, so this also checks that they pass every other saved tensor on.
    assert every - saved(4) == 7 * stream_bytes
    assert every - saved(10) == 9 * stream_bytes


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["mhc"])
def test_peak_memory_of_a_step_falls_with_the_streams_not_kept(spec, rng_seed):
    model = _model(spec, n_blocks=8)  # L = 16: 4 of 16 streams kept, 3 recomputed at a time
    b, t = 4, 64
    idx, targets = torch.randint(0, 512, (b, t)), torch.randint(0, 512, (b, t))
    stream_bytes = b * t * getattr(model.mixer, "n", 1) * model.cfg.d_model * 4

    def peak(segment):
        model.mixer.stream_segment = segment
        model.zero_grad(set_to_none=True)
        gc.collect()
        return cpu_peak_allocated_bytes(lambda: F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward())

    assert peak(1) - peak(None) >= (16 - 4 - 3) * stream_bytes


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["mhc"])
def test_the_tape_lives_no_longer_than_the_graph(spec, monkeypatch, rng_seed):
    tapes = []
    init = tape_module.Tape.__init__

    def remember(self, segment, step):
        init(self, segment, step)
        tapes.append(weakref.ref(self))

    monkeypatch.setattr(tape_module.Tape, "__init__", remember)
    model = _model(spec)
    idx = torch.randint(0, 512, (2, 16))
    logits = model(idx)  # a forward whose graph is dropped without a backward
    assert tapes[-1]() is not None
    del logits
    assert tapes[-1]() is None  # freed by reference counting: no cycle through the graph
    model(idx).sum().backward()
    assert tapes[-1]() is None
    with torch.no_grad():  # nothing is saved without gradients, so no tape is made
        model(idx)
    assert len(tapes) == 2
