"""The cost targets of the depth mixers as ratios to PreLN, and each variant's analytic floor from its own cost
model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from harness.benchmarks.reference import BASELINE
from harness.config import ModelConfig

# Ratios to PreLN (time, memory) that the optimisation work aims for at every depth from 8 to 48 layers: width 256,
# seq 256, batch 8, vocabulary 4096, float32, CPU. Keys are canonical variant names, so ``ldm-rls`` means its
# defaults (G = 16).
TARGETS: dict[str, tuple[float, float]] = {
    "ldm": (1.10, 1.20),
    "ldm-rls": (1.25, 1.30),
    "attnres-block": (1.10, 1.20),
    "mhc": (1.10, 1.20),
    "hc": (1.10, 1.20),
    "denseformer": (1.10, 1.20),
}


# Full AttnRes reads every earlier output, so its time must grow with depth: only its memory has a target at every
# depth; its time target, 1.30x, applies at 48 layers.
GROWTH_ONLY = ("attnres",)


GROWTH_TARGETS = {"attnres": (1.30, 1.30, 48)}


# PreLN against the plain pre-norm trunk (its reference): what the depth-mixing interface itself may cost.
PRELN_TARGET = (1.02, 1.02)


# State streams are kept in float32 even under bf16 autocast (spec §1), so a carried float costs 4 bytes.
STATE_BYTES_PER_FLOAT = 4


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward matmul FLOPs per token of the PreLN decoder (2 per multiply-add), attention scores counted in full."""
    d, f = cfg.d_model, cfg.ffn_hidden
    attention = 2 * 4 * d * d + 2 * 2 * seq_len * d  # q, k, v, o projections; then q·k and weights·v
    mlp = 2 * 3 * d * f  # gate, up and down projections of SwiGLU
    head = 2 * d * cfg.vocab_size
    return cfg.n_blocks * (attention + mlp) + head


def analytic_floor(mixer, cfg: ModelConfig, seq_len: int) -> dict:
    """The analytic floor of a variant from its cost model (NaN where a variant does not give one)."""
    try:
        extra = float(mixer.extra_flops_per_token())
    except NotImplementedError:
        extra = math.nan
    try:
        floats = float(mixer.stream_floats_per_token())
    except NotImplementedError:
        floats = math.nan
    model_flops = model_flops_per_token(cfg, seq_len)
    return {
        "floor_flops_per_token": extra,
        "model_flops_per_token": model_flops,
        "floor_time_ratio": 1.0 + extra / model_flops,
        "floor_state_bytes_per_token": floats * STATE_BYTES_PER_FLOAT,
        "floor_state_ratio": floats / cfg.d_model,
    }


def target_of(name: str, depth: int | None = None) -> tuple[str, Callable[[float, float], str]]:
    """The target text of a canonical variant name and how to mark a (time, memory) ratio pair against it.

    For ``preln`` the pair is its ratio to the plain trunk; for every other variant, its ratio to ``preln``.
    """

    def mark_of(t, m):
        return lambda rt, rm: "met" if rt <= t and rm <= m else "not met"

    if name in TARGETS:
        t, m = TARGETS[name]
        return f"<={t:.2f}x time, <={m:.2f}x mem", mark_of(t, m)
    if name in GROWTH_TARGETS:
        t, m, at = GROWTH_TARGETS[name]
        if depth == at:
            return f"<={t:.2f}x time at L={at}, <={m:.2f}x mem", mark_of(t, m)
        return f"<={m:.2f}x mem (time: growth with depth)", mark_of(math.inf, m)
    if name == BASELINE:
        t, m = PRELN_TARGET
        return f"<={t:.2f}x time, <={m:.2f}x mem of the plain trunk", mark_of(t, m)
    return "", lambda rt, rm: ""
