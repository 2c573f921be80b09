"""Activation checkpointing (``train.activation_checkpointing``): each layer's inner activations are recomputed in
the backward pass, the depth mixer's state is kept, and nothing about the step changes but the memory it holds."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F

import variants
from harness.config import build_config, model_preset
from harness.model.factory import build_model
from harness.training.trainer import train

pytestmark = pytest.mark.usefixtures("shared_cache")


def _step(model, idx):
    """Loss, every parameter's gradient, and the bytes autograd saved for the backward pass."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes() if t.device.type != "meta" else 0)
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sum(saved)


@pytest.mark.parametrize("variant", variants.names())
def test_checkpointed_layers_give_the_same_loss_and_gradients_bit_for_bit(variant, rng_seed):
    cfg = model_preset("tiny", n_blocks=3)
    torch.manual_seed(rng_seed)
    model = build_model(cfg, variant)
    idx = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(rng_seed))
    loss, grads, kept = _step(model, idx)
    model.checkpoint_layers = True
    loss_ckpt, grads_ckpt, kept_ckpt = _step(model, idx)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ckpt[name]), name
    # What autograd keeps counts storages once per saved reference, so the drop is an upper bound on the memory
    # saved; it must be a real one: every layer's attention or MLP activations are no longer kept.
    assert kept_ckpt < 0.8 * kept, (kept_ckpt, kept)


@pytest.mark.slow
def test_a_run_with_checkpointed_layers_follows_the_same_curve(tmp_path):
    settings = {
        "max_steps": 6,
        "log_every_steps": 1,
        "val_every_steps": 6,
        "val_batches": 1,
        "ckpt_every_steps": 6,
        "seq_len": 32,
        "batch_size": 4,
        "warmup_steps": 1,
    }
    curves = []
    for on in (False, True):
        cfg = build_config(
            {
                "model": {"preset": "tiny"},
                "variant": "ldm-rls",
                "train": {**settings, "activation_checkpointing": on},
            }
        )
        run = train(cfg, tmp_path / f"ckpt-{on}")
        with open(run / "metrics.csv", newline="") as f:
            curves.append([(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(f)])
    assert curves[0] == curves[1] and len(curves[0]) >= 6


def test_the_checkpointing_benchmark_prints_both_settings_per_variant(capsys):
    from harness.benchmarks import checkpointing

    checkpointing.main(
        ["--preset", "tiny", "--repeats", "2", "--variants", "preln,ldm", "--seq", "16", "--batch-size", "2"]
    )
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["preln", "ldm"]
    for _, off, on, ratio in rows:
        off, on, ratio = float(off), float(on), float(ratio)
        assert off > 0 and on > 0
        # the ratio of the unrounded medians, within what rounding the printed ones to 3 decimals allows
        assert (on - 5e-4) / (off + 5e-4) - 5e-3 <= ratio <= (on + 5e-4) / max(off - 5e-4, 1e-9) + 5e-3
