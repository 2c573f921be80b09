"""How many sequences fit one card: the memory of a whole training step, measured at a few micro batches.

For every variant one step (forward under the run's precision, cross-entropy, backward, AdamW) is measured at each
micro batch, with the optimizer's state already allocated, as in every step after the first. The peak is the
allocator's (``AllocatorPeak``: ``torch.cuda.max_memory_allocated`` on a card, the profiler's allocator totals on a
CPU; tensors only), plus what the step holds before it starts (weights, buffers, AdamW state). Memory grows about
linearly with the micro batch (every activation is per sequence), so a line through two micro batches gives the
fixed part and the bytes per sequence; with more, the line is their least-squares fit and ``peak_bytes`` shows how
close each measurement lies to it. At tiny sizes the peak can move between backward and the optimizer step, and
the line is rougher.

A card holds more than the step's tensors: the CUDA context, the collective library's buffers, DDP's gradient
buckets (one more copy of the gradients) and what the caching allocator keeps unused. ``fit`` therefore leaves
``headroom`` of the card and one bucket copy of the gradients aside before it divides by the bytes per sequence.
Measured on a CPU the numbers are the same tensors in the same precision (CPU autocast casts as CUDA autocast
does), not a card's own allocator; ``docs/cluster.md`` says which was used for the committed profiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from harness.benchmarks.benchmark import resolve_variants
from harness.config import model_preset
from harness.measure import AllocatorPeak, live_training_bytes
from harness.model.factory import build_model
from harness.training.memory_plan import training_step

GIB = 1024**3


def step_bytes(model, micro_batch: int, seq_len: int, *, dtype: str = "bf16", seed: int = 0) -> int:
    """Peak bytes of one training step at ``micro_batch`` sequences of ``seq_len`` tokens, AdamW state included."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():  # allocate AdamW's state as a first step would, without running one
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(model.cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen).to(device)
    held = live_training_bytes(model, [optimizer])
    peak = AllocatorPeak(device)
    peak.start()
    training_step(model, optimizer, tokens, "bf16-mixed" if dtype == "bf16" else "32-true")
    optimizer.zero_grad(set_to_none=True)
    return held + peak.stop()


def micro_batch_memory(
    variants: Sequence[str] | None = None,
    *,
    preset: str = "gpt2-small",
    seq_len: int = 1024,
    micro_batches: Sequence[int] = (1, 2),
    dtype: str = "bf16",
    device: str = "cpu",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
):
    """One row per variant and micro batch: parameters and the step's peak bytes, with the line through them
    (``fixed_bytes`` + ``bytes_per_sequence`` × micro batch, least squares over the micro batches)."""
    import numpy as np
    import pandas as pd

    if len(set(micro_batches)) < 2 or min(micro_batches) < 1:
        raise ValueError(f"micro_batches needs two or more distinct positive sizes, got {list(micro_batches)}")
    cfg = model_preset(preset, max_seq_len=max(seq_len, model_preset(preset).max_seq_len))
    rows = []
    for name in resolve_variants(variants):
        torch.manual_seed(seed)
        model = build_model(cfg, name).to(device).train()
        params = sum(p.numel() for p in model.parameters())
        measured = [step_bytes(model, m, seq_len, dtype=dtype, seed=seed) for m in micro_batches]
        slope, intercept = np.polyfit(np.array(micro_batches, dtype=float), np.array(measured, dtype=float), 1)
        for m, b in zip(micro_batches, measured):
            rows.append(
                {
                    "variant": name,
                    "params": params,
                    "micro_batch": m,
                    "peak_bytes": b,
                    "fixed_bytes": intercept,
                    "bytes_per_sequence": slope,
                }
            )
        if log:
            log(f"  {name}: {intercept / GIB:.2f} GiB fixed + {slope / GIB:.3f} GiB per sequence")
        del model
    frame = pd.DataFrame(rows)
    frame.attrs["meta"] = {
        "preset": preset,
        "seq_len": seq_len,
        "dtype": dtype,
        "device": device,
        "torch": torch.__version__,
        "memory_method": "allocator peak of one AdamW step, optimizer state allocated",
    }
    return frame


def fit(fixed_bytes: float, bytes_per_sequence: float, params: int, card_gib: float, headroom: float = 0.15) -> int:
    """The largest micro batch whose step fits ``card_gib`` with ``headroom`` of the card and DDP's gradient
    buckets (4 bytes per parameter) left aside; 0 when not even one sequence fits."""
    usable = card_gib * GIB * (1 - headroom) - fixed_bytes - 4 * params
    return max(0, math.floor(usable / bytes_per_sequence))


def fit_table(frame, cards_gib: Sequence[float] = (40, 80), headroom: float = 0.15):
    """Per variant: the fitted line and the largest micro batch for each card size."""
    per_variant = frame.drop_duplicates("variant")[["variant", "params", "fixed_bytes", "bytes_per_sequence"]]
    out = per_variant.copy()
    out["fixed_GiB"] = out.fixed_bytes / GIB
    out["GiB_per_sequence"] = out.bytes_per_sequence / GIB
    for card in cards_gib:
        out[f"fits_{card:g}GB"] = [
            fit(r.fixed_bytes, r.bytes_per_sequence, int(r.params), card, headroom) for r in per_variant.itertuples()
        ]
    return out.drop(columns=["fixed_bytes", "bytes_per_sequence"]).reset_index(drop=True)
