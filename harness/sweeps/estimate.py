"""What a sweep costs before it runs: parameters, steps, tokens, training FLOPs and GPU-hours per run.

Training FLOPs are three times the forward FLOPs of the cost model (``harness.model.costs``: PreLN's matrix multiplies
and attention at the run's context, plus what the run's depth mixer adds), times the tokens the run trains on;
the backward pass costs twice the forward. GPU-hours assume the profile's ``utilisation`` of one card's bf16
peak (``gpu_peak_tflops``), so they are a planning number, not a measurement: the card's real utilisation
depends on the variant, the micro batch and the interconnect. Where ``make gpu-bench`` has timed a card of that peak,
a run of a measured variant is priced at the measured rate instead (``harness.benchmarks.measured``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from harness import units
from harness.config import ModelConfig, RunConfig
from harness.model.factory import build_model
from harness.sweeps.jobstate import format_rows
from harness.training.budget import seq_len_of, train_steps


def _model_counts(cfg: RunConfig) -> tuple[int, int, ModelConfig]:
    """Parameters, forward depth-mixing FLOPs per token and the decoder's own size of the run's model, built on
    the meta device. The size is the built decoder's: ``preln(match=...)`` widens its MLPs, and they cost FLOPs."""

    from harness.model.costs import mixer_flops_per_token

    with torch.device("meta"):  # shapes without storage: even the largest preset allocates nothing
        model = build_model(cfg.model, cfg.variant)
    return model.num_params(), mixer_flops_per_token(model.mixer), model.cfg


def run_cost(cfg: RunConfig, *, peak_tflops: float, utilisation: float, _cache: dict | None = None) -> dict[str, Any]:
    """Parameters, steps, tokens, training FLOPs and estimated GPU-hours of one run."""
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.model.costs import preln_flops_per_token

    key = (repr(cfg.model), cfg.variant)
    counts = _cache.get(key) if _cache is not None else None
    if counts is None:
        counts = _model_counts(cfg)
        if _cache is not None:
            _cache[key] = counts
    params, extra, built = counts
    seq_len = seq_len_of(cfg)
    steps = train_steps(cfg)
    tokens = steps * cfg.train.batch_size * seq_len
    flops = 3 * (preln_flops_per_token(built, seq_len) + extra) * tokens
    gpu_hours = flops / (utilisation * peak_tflops * 1e12) / 3600
    return {"params": params, "steps": steps, "tokens": tokens, "train_flops": float(flops), "gpu_hours": gpu_hours}


def sweep_cost(
    configs: Iterable[RunConfig], *, peak_tflops: float, utilisation: float, steps_csv: Path | None = None
) -> list[dict[str, Any]]:
    """``run_cost`` of every config (models of the same size and variant are counted once), at the rates measured in
    ``steps_csv`` (a ``make gpu-bench`` output) where it has the card and the variant."""
    from harness.benchmarks.measured import apply_measured

    cache: dict = {}
    configs = list(configs)
    costs = [run_cost(c, peak_tflops=peak_tflops, utilisation=utilisation, _cache=cache) for c in configs]
    return apply_measured(configs, costs, peak_tflops, steps_csv)


def describe_costs(runs, profile, steps_csv: Path | None = None) -> str:
    """The dry run's cost block: one row per run, then the sweep's total and the hours each run takes."""

    from harness.benchmarks.measured import basis_note

    costs = sweep_cost(
        [r.cfg for r in runs], peak_tflops=profile.gpu_peak_tflops, utilisation=profile.utilisation, steps_csv=steps_csv
    )
    rows = [
        {
            "run_id": r.run_id,
            "params": units.si(c["params"]),
            "steps": c["steps"],
            "tokens": units.tokens(c["tokens"]),
            "train_flops": f"{c['train_flops']:.3e}",
            "gpu_time": units.gpu_time(c["gpu_hours"]),
        }
        for r, c in zip(runs, costs)
    ]
    total_flops = sum(c["train_flops"] for c in costs)
    total_hours = sum(c["gpu_hours"] for c in costs)
    gpus = profile.nodes * profile.gpus_per_node
    lines = [
        f"cost (training FLOPs = 3 x forward FLOPs of the cost model x tokens; "
        f"{basis_note(costs, profile.utilisation, profile.gpu_peak_tflops)}; profile {profile.name}):",
        format_rows(rows, ["run_id", "params", "steps", "tokens", "train_flops", "gpu_time"]),
        f"total: {len(costs)} run(s), {units.tokens(sum(c['tokens'] for c in costs))} tokens, "
        f"{total_flops:.3e} training FLOPs, {units.gpu_time(total_hours)}",
    ]
    if gpus and costs:
        wall = units.duration(total_hours / len(costs) / gpus * 3600)
        lines[-1] += f"; {wall} of wall time per run on its {gpus} GPU(s)"
    return "\n".join(lines)


def describe_memory(runs, card_gb: float = 0, log=None) -> str:
    """The dry run's memory block: per distinct model, micro batch and strategy, one process's peak and the largest
    micro batch each card holds (``harness.training.memory_plan``), then a warning for each that does not fit the
    profile's card (``card_gb``; where it is 0, the largest card). ``log`` hears how many models are simulated
    before the simulations start."""
    from harness.training.memory_plan import CARDS_GB, HEADROOM, distinct_models, plans

    if log:
        n = distinct_models([r.cfg for r in runs])
        log(f"memory plan: simulating a training step of {n} model(s) on shapes (--no-memory-plan skips it)")
    planned = plans([r.cfg for r in runs])
    card = card_gb or max(CARDS_GB)
    cards = sorted({*CARDS_GB, card})
    rows, warnings, seen = [], [], {}
    for r, m in zip(runs, planned):
        key = (r.cfg.variant, repr(r.cfg.model), m)
        if key in seen:
            seen[key]["runs"] += 1
            continue
        c = r.cfg.model
        row = {
            "variant": r.cfg.variant,
            "model": f"{c.n_blocks}x{c.d_model}",
            "params": units.si(m.params),
            "runs": 1,
            "strategy": m.strategy,
            "processes": m.world,
            "ckpt": "yes" if m.checkpointing else "no",
            "micro_batch": m.micro_batch,
            "per_process": units.si(m.peak(), "B"),
            "per_sequence": units.si(m.per_sequence, "B"),
            **{f"fits_{g:g}GB": m.fits(g) for g in cards},
        }
        seen[key] = row
        rows.append(row)
        if m.fits(card) < m.micro_batch:
            warnings.append(_does_not_fit(r.cfg.variant, row["model"], m, card))
    lines = [
        "memory per process (one training step simulated on shapes: weights, AdamW state, activations and "
        "temporaries at the run's micro batch and precision on a card, auto being bf16-mixed; fits_*: the largest "
        "micro batch with "
        f"{HEADROOM:.0%} of the card aside):",
        format_rows(rows, list(rows[0]) if rows else []),
    ]
    return "\n".join(lines + warnings)


def _does_not_fit(variant: str, model: str, m, card: float) -> str:
    from harness.training.memory_plan import HEADROOM

    fits = m.fits(card)
    if fits:
        remedy = f"set train.micro_batch_size={fits} or lower"
    else:
        steps = ["shard it (train.strategy=fsdp)"] if m.strategy != "fsdp" else []
        if not m.checkpointing:
            steps.append("checkpoint its layers (train.activation_checkpointing=true)")
        remedy = ", ".join(steps + ["shorten its sequences or take a larger card"])
    return (
        f"warning: {variant} at {model} needs {units.si(m.peak(), 'B')} per process at micro batch {m.micro_batch}, "
        f"more than a {card:g} GB card holds with {HEADROOM:.0%} aside; {remedy}"
    )
