"""GPU-hours from measurement: what the dry run's cost estimate uses where ``make gpu-bench`` has timed the card.

A results folder's ``gpu-bench/steps.csv`` (``make gpu-bench`` writes ``results/gpu-bench``; a sweep reads the
one in the ``--results`` folder it is planned in) holds, per variant and depth, the model FLOP/s a compiled
training step reached on a card (``model_tflops``: three times the forward FLOPs per token of the cost model,
PreLN's and the mixer's, times the measured tokens/s), and the width and context it was timed at. A run whose
profile names a card of the same bf16 peak (``gpu_peak_tflops``) and whose variant was measured (the same canonical
name, else its family's default) at its width and context is priced at that rate, from the measured depth nearest
its own: ``GPU-hours = training FLOPs / measured FLOP/s``, which is ``tokens / measured tokens/s`` at the
benchmark's shape. Every other run keeps the profile's assumed ``utilisation`` of the peak.
"""

from __future__ import annotations

from pathlib import Path


def measured_rates(peak_tflops: float, path: Path | None) -> tuple[str, dict[str, dict[tuple[int, int, int], float]]]:
    """The card with this bf16 peak benchmarked in ``path`` (a ``steps.csv``) and its compiled steps' model TFLOP/s
    by variant and (width, context, depth); ("", {}) when there is no such benchmark."""
    import pandas as pd

    from harness.model.roofline import card_named

    if path is None or not path.exists():
        return "", {}
    frame = pd.read_csv(path)
    if not {"card", "model_tflops", "mode", "variant", "depth", "d_model", "seq_len"} <= set(frame.columns):
        return "", {}
    frame = frame[(frame["mode"] == "compiled") & frame.model_tflops.notna()]
    frame = frame[[(c := card_named(str(n))) is not None and c.peak_tflops == peak_tflops for n in frame.card]]
    rates: dict[str, dict[tuple[int, int, int], float]] = {}
    for row in frame.itertuples():
        rates.setdefault(row.variant, {})[int(row.d_model), int(row.seq_len), int(row.depth)] = float(row.model_tflops)
    return (str(frame.card.iloc[0]) if len(frame) else ""), rates


def apply_measured(configs, costs: list[dict], peak_tflops: float, path: Path | None) -> list[dict]:
    """``costs`` (one dict per run, from ``run_cost``) with ``gpu_hours`` from the measured rate where there is one
    at the run's width and context, and ``gpu_hours_basis`` naming what each one rests on."""
    import variants
    from harness.training.budget import seq_len_of

    card, rates = measured_rates(peak_tflops, path)
    for cfg, cost in zip(configs, costs):
        spec = variants.spec(cfg.variant)
        shape = (cfg.model.d_model, seq_len_of(cfg))
        measured = rates.get(str(spec)) or rates.get(spec.name) or {}
        by_depth = {depth: rate for (d, t, depth), rate in measured.items() if (d, t) == shape}
        if not by_depth:
            cost["gpu_hours_basis"] = "assumed"
            continue
        depth = min(by_depth, key=lambda d: (abs(d - cfg.model.n_layers), d))
        cost["gpu_hours"] = cost["train_flops"] / (by_depth[depth] * 1e12) / 3600
        cost["gpu_hours_basis"] = f"measured on {card}"
    return costs


def basis_note(costs: list[dict], utilisation: float, peak_tflops: float) -> str:
    """What the GPU time of a table of runs rests on, in words."""
    measured = sorted({c["gpu_hours_basis"] for c in costs} - {"assumed"})
    assumed = sum(c["gpu_hours_basis"] == "assumed" for c in costs)
    peak = f"{utilisation:.0%} of a {peak_tflops:g} TFLOP/s bf16 peak, assumed"
    if not measured:
        return f"GPU time at {peak} (no make gpu-bench of a card with this peak in the results folder's gpu-bench)"
    where = ", ".join(m.removeprefix("measured on ") for m in measured)
    note = f"GPU time of {len(costs) - assumed} run(s) at the model FLOP/s their variant reached on {where} (make "
    note += "gpu-bench, compiled, nearest depth)"
    return note + (f", of {assumed} at {peak}" if assumed else "")
