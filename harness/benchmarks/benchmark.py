"""The cost benchmark: training-step time and peak memory of every depth mixer against PreLN, measured in one run.

For each shape (depth ``L``, width ``d``, sequence length ``T``) one model per variant is built from the same seed.
Timed forward+backward steps run interleaved, ``preln, v1, preln, v2, ..., preln`` in every repeat, so each
variant is timed between two PreLN measurements and its ratio is taken against their mean: drift from a busy
machine hits both sides of the ratio. Times are medians over repeats. Peak memory is measured once per model in
a separate step (it does not drift): on CUDA with ``torch.cuda.max_memory_allocated``, on CPU from the allocator
totals that ``torch.profiler`` records with ``profile_memory=True``; both count the model's parameters plus
everything a step allocates (activations, logits, gradients, temporaries), no optimizer state. Beside each
measurement stands the analytic floor from the variant's own cost model (``targets``), and ``outputs.scaling`` fits
how each variant's extra cost grows with ``L``, ``d`` and ``T``. Steps are timed through ``timing``, memory measured
through ``memory``, and each variant's straightforward implementation comes from ``reference``.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.benchmarks import quiet
from harness.benchmarks.memory import peak_step_bytes
from harness.benchmarks.outputs import write_outputs
from harness.benchmarks.reference import BASELINE, REFERENCE, reference_model
from harness.benchmarks.targets import analytic_floor, target_of
from harness.benchmarks.timing import step_fn, time_steps
from harness.config import PRESETS, ModelConfig, model_preset
from harness.errors import RunFailed, UsageError
from harness.io import writable_dir
from harness.model.factory import build_model
from harness.rundir import git_revision

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bfloat16": "bf16"}


DEVICES = ("cpu", "cuda")


# Columns of the CSV, in order.
COLUMNS = [
    "variant",
    "depth",
    "width",
    "seq_len",
    "batch_size",
    "vocab_size",
    "device",
    "dtype",
    "threads",
    "repeats",
    "step_time_ms",
    "tokens_per_s",
    "peak_mem_bytes",
    "saved_activation_bytes",
    "ratio_time",
    "ratio_time_iqr",
    "ratio_mem",
    "extra_time_ms",
    "extra_mem_bytes",
    "floor_flops_per_token",
    "model_flops_per_token",
    "floor_time_ratio",
    "floor_state_bytes_per_token",
    "floor_state_ratio",
    "target",
    "met",
    "ref_impl",
    "ref_step_time_ms",
    "ref_peak_mem_bytes",
    "ratio_time_vs_ref",
    "ratio_time_vs_ref_iqr",
    "ratio_mem_vs_ref",
    "vs_ref",
]


@dataclass(frozen=True)
class Shape:
    """One point of the grid: depth-mixing layers, model width and sequence length."""

    depth: int
    width: int
    seq_len: int


def model_config(preset: str, shape: Shape, vocab_size: int | None = None) -> ModelConfig:
    """The preset resized to ``shape``: ``n_blocks = L / 2``, the MLP keeps the preset's width ratio."""
    base = PRESETS.get(preset)
    if base is None:
        model_preset(preset)  # raises the UsageError that lists the presets
    ffn = max(1, round(base["ffn_hidden"] * shape.width / base["d_model"]))
    return model_preset(
        preset,
        n_blocks=shape.depth // 2,
        d_model=shape.width,
        ffn_hidden=ffn,
        max_seq_len=max(base["max_seq_len"], shape.seq_len),
        vocab_size=vocab_size or base["vocab_size"],
    )


def _normalise_dtype(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = {torch.float32: "float32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise UsageError(f"Unknown dtype {dtype!r}: allowed values are {', '.join(DTYPES)}.")
    return name


def _positive_ints(name: str, values: Iterable[int], *, even: bool = False) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if not out:
        raise UsageError(f"{name} needs at least one value.")
    for v in out:
        if v < 1 or (even and v % 2):
            kind = "positive even integers (L = 2 * n_blocks)" if even else "positive integers"
            raise UsageError(f"{name} must be {kind}, got {v}.")
    return tuple(dict.fromkeys(out))


def resolve_variants(names: Sequence[str] | None) -> list[str]:
    """The variants to measure, canonical and deduplicated, with the PreLN baseline first."""
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    import variants

    if isinstance(names, str):
        names = [names]
    chosen = list(variants.names()) if not names else [n for n in names if n and n.strip()]
    if not chosen:
        raise UsageError(f"No variants given: choose from {', '.join(variants.names())}.")
    out = [BASELINE]
    for spec in chosen:
        name = variants.canonical(spec)  # raises a UsageError naming the known variants and knobs
        if name not in out:
            out.append(name)
    return out


def schedule(names: Sequence[str], repeats: int, references: Sequence[str] = ()) -> list[list[str]]:
    """Per repeat, the order of timed steps: every variant between two PreLN steps, order reversed on odd repeats.

    A variant named in ``references`` is timed next to its reference (``name + REFERENCE``), both between the same
    two PreLN steps, in alternating order; PreLN's own reference (the plain trunk) sits alone between two.
    """
    groups = [[BASELINE + REFERENCE]] if BASELINE in references else []
    groups += [[n, n + REFERENCE] if n in references else [n] for n in names if n != BASELINE]
    rounds = []
    for r in range(repeats):
        order = [BASELINE]
        for group in groups if r % 2 == 0 else [g[::-1] for g in groups[::-1]]:
            order += group + [BASELINE]
        rounds.append(order)
    return rounds


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def _measure_shape(
    names,
    shape,
    *,
    preset,
    vocab,
    batch_size,
    device,
    dtype,
    repeats,
    warmup,
    steps_per_repeat,
    seed,
    threads,
    references,
    log,
) -> list[dict]:
    if log:
        log(
            f"measuring {len(names)} variants at depth {shape.depth}, width {shape.width}, "
            f"seq {shape.seq_len} on {device} with {threads} threads"
        )
    cfg = model_config(preset, shape, vocab)
    models, steps, impls = _build_steps(names, cfg, shape, batch_size, device, dtype, seed, references)
    timed = list(models)
    for _ in range(warmup):
        for name in timed:
            steps[name]()
            models[name].zero_grad(set_to_none=True)

    def done(r: int) -> None:
        if log:
            log(f"  {shape}: repeat {r + 1}/{repeats} done")

    times, ratios, extras, vs_ref = _time_rounds(names, models, steps, impls, repeats, steps_per_repeat, device, done)
    memory = {name: peak_step_bytes(models[name], steps[name], device) for name in timed}
    rows = []
    base_mem = memory[BASELINE][0]
    for name in names:
        step_s = statistics.median(times[name])
        ratio_time = 1.0 if name == BASELINE else statistics.median(ratios[name])
        mem, saved = memory[name]
        ratio_mem = mem / base_mem
        ref = _reference_columns(name, impls, times, memory, vs_ref)
        target, mark = target_of(name, shape.depth)
        if name == BASELINE:
            met = mark(ref["ratio_time_vs_ref"], ref["ratio_mem_vs_ref"]) if name in impls else ""
        else:
            met = mark(ratio_time, ratio_mem)
        rows.append(
            {
                "variant": name,
                "depth": shape.depth,
                "width": shape.width,
                "seq_len": shape.seq_len,
                "batch_size": batch_size,
                "vocab_size": cfg.vocab_size,
                "device": device.type,
                "dtype": dtype,
                "threads": threads,
                "repeats": repeats,
                "step_time_ms": step_s * 1e3,
                "tokens_per_s": batch_size * shape.seq_len / step_s,
                "peak_mem_bytes": mem,
                "saved_activation_bytes": saved,
                "ratio_time": ratio_time,
                "ratio_time_iqr": _iqr(ratios[name]),
                "ratio_mem": ratio_mem,
                "extra_time_ms": 0.0 if name == BASELINE else statistics.median(extras[name]) * 1e3,
                "extra_mem_bytes": mem - base_mem,
                **analytic_floor(models[name].mixer, cfg, shape.seq_len),
                "target": target,
                "met": met,
                **ref,
            }
        )
    del models, steps
    gc.collect()
    return rows


def _build_steps(names, cfg, shape, batch_size, device, dtype, seed, references):
    """Each variant's model and training step on one batch, and with ``references`` its reference beside it."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch_size, shape.seq_len + 1), generator=gen)
    idx, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (b, t) each
    models, steps, impls = {}, {}, {}
    for name in names:
        torch.manual_seed(seed)  # every variant starts from the same draw, so the decoders match
        models[name] = build_model(cfg, name).to(device).train()
        steps[name] = step_fn(models[name], idx, targets, dtype)
        ref = reference_model(name, models[name]) if references else None
        if ref is not None:
            key = name + REFERENCE
            models[key], impls[name] = ref[0].to(device).train(), ref[1]
            steps[key] = step_fn(models[key], idx, targets, dtype)
    return models, steps, impls


def _time_rounds(names, models, steps, impls, repeats, steps_per_repeat, device, done):
    """Step times by model over the repeats, and each one's ratio and extra time against its PreLN neighbours."""
    timed = list(models)
    times: dict[str, list[float]] = {n: [] for n in timed}
    ratios: dict[str, list[float]] = {n: [] for n in timed}
    extras: dict[str, list[float]] = {n: [] for n in timed}
    vs_ref: dict[str, list[float]] = {n: [] for n in impls}
    for r, order in enumerate(schedule(names, repeats, list(impls))):
        gc.collect()
        gc.disable()  # a collection inside a timed step is noise of the harness, not of the variant
        try:
            measured = []
            for name in order:
                measured.append((name, time_steps(steps[name], steps_per_repeat, device)))
                models[name].zero_grad(set_to_none=True)
        finally:
            gc.enable()
        this = {}
        for i, (name, sec) in enumerate(measured):
            times[name].append(sec)
            this[name] = sec
            if name != BASELINE:
                before = next(s for n, s in reversed(measured[:i]) if n == BASELINE)
                after = next(s for n, s in measured[i + 1 :] if n == BASELINE)
                base = (before + after) / 2
                ratios[name].append(sec / base)
                extras[name].append(sec - base)
        for name in impls:
            if name == BASELINE:  # PreLN against the plain trunk, from the trunk's two PreLN neighbours
                vs_ref[name].append(1.0 / ratios[name + REFERENCE][-1])
            else:
                vs_ref[name].append(this[name] / this[name + REFERENCE])
        # PreLN against its neighbour PreLN: the drift the sandwich has to absorb, reported as its spread.
        base_times = [s for n, s in measured if n == BASELINE]
        ratios[BASELINE] += [b / a for a, b in zip(base_times, base_times[1:])] or [1.0]
        done(r)
    return times, ratios, extras, vs_ref


def _reference_columns(name, impls, times, memory, vs_ref) -> dict:
    """The columns comparing a variant with its reference implementation (NaN and blank without one)."""
    mem = memory[name][0]
    ref = {
        "ref_impl": "",
        "ref_step_time_ms": math.nan,
        "ref_peak_mem_bytes": math.nan,
        "ratio_time_vs_ref": math.nan,
        "ratio_time_vs_ref_iqr": math.nan,
        "ratio_mem_vs_ref": math.nan,
        "vs_ref": "",
    }
    if name in impls:
        key = name + REFERENCE
        vt = statistics.median(vs_ref[name])
        ref.update(
            ref_impl=impls[name],
            ref_step_time_ms=statistics.median(times[key]) * 1e3,
            ref_peak_mem_bytes=memory[key][0],
            ratio_time_vs_ref=vt,
            ratio_time_vs_ref_iqr=_iqr(vs_ref[name]),
            ratio_mem_vs_ref=mem / memory[key][0],
            # No faster than its own straightforward form is a failure, beyond the run's noise.
            vs_ref="slower" if vt > 1.0 + max(0.02, _iqr(vs_ref[name])) else "ok",
        )
    return ref


def _checked_settings(preset, depths, widths, seqs, dtype, device, vocab, threads, counts: dict):
    """The shapes to measure and the dtype, once every setting is one the benchmark accepts."""
    if preset not in PRESETS:
        model_preset(preset)
    base = PRESETS[preset]
    depths = _positive_ints("--depths", depths or (2 * base["n_blocks"],), even=True)
    widths = _positive_ints("--widths", widths or (base["d_model"],))
    seqs = _positive_ints("--seq", seqs)
    for label, (value, least) in counts.items():
        if int(value) != value or value < least:
            raise UsageError(f"{label} must be an integer of at least {least}, got {value}.")
    if vocab is not None and vocab < 2:
        raise UsageError(f"--vocab must be an integer of at least 2, got {vocab}.")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be a positive integer, got {threads}.")
    dtype = _normalise_dtype(dtype)
    if device not in DEVICES:
        raise UsageError(f"Unknown device {device!r}: allowed values are {', '.join(DEVICES)}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; use --device cpu.")
    return depths, widths, seqs, dtype


def _meta(df, device: str, load_before, others_before, others_during, run: dict) -> dict:
    """What bench_meta.json records about a run: its settings, the code and machine, and how busy the machine was."""
    return {
        "preset": run["preset"],
        "vocab_size": int(df["vocab_size"].iloc[0]),
        "threads": run["threads"],
        "device": device,
        "dtype": run["dtype"],
        "batch_size": run["batch_size"],
        "repeats": run["repeats"],
        "warmup": run["warmup"],
        "steps_per_repeat": run["steps_per_repeat"],
        "seed": run["seed"],
        "torch": torch.__version__,
        "git_revision": git_revision(),  # the code measured, for before/after comparisons across commits
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "loadavg_before": load_before,
        "loadavg_after": quiet.loadavg(),
        # Cores other processes kept busy, in the second before and on average during the run (quiet.py).
        "others_before": others_before,
        "others_during": others_during,
        "busy": quiet.is_busy(others_before, others_during),
        "references": run["references"],
        "gpu": torch.cuda.get_device_name(torch.device(device)) if device == "cuda" else "",
        "memory_method": (
            "torch.cuda.max_memory_allocated"
            if device == "cuda"
            else "torch.profiler allocator totals (profile_memory=True)"
        ),
    }


def _check_models_build(names, grid, preset, vocab) -> None:
    """Every variant builds at every shape, checked before anything is timed."""
    import variants as registry

    for shape in grid:
        cfg = model_config(preset, shape, vocab)
        for name in names:
            registry.validate(name, d_model=cfg.d_model, n_layers=cfg.n_layers)


def _refuse_busy(others: float, made_out_dir) -> None:
    """Refuse a busy machine; a refused run leaves nothing behind, not even the empty folder it made."""
    if made_out_dir is not None and not any(Path(made_out_dir).iterdir()):
        Path(made_out_dir).rmdir()
    raise RunFailed(
        f"The machine is busy (other processes keep {others:.2f} of its {os.cpu_count()} CPUs busy, "
        f"more than {quiet.OTHERS_LIMIT}): reference numbers need a quiet machine; try again later."
    )


def _refuse_turned_busy(others: float, out_dir) -> None:
    raise RunFailed(
        f"The machine became busy during the run (other processes kept {others:.2f} of its "
        f"{os.cpu_count()} CPUs busy on average, more than {quiet.OTHERS_LIMIT}): nothing was written to "
        f"{str(out_dir)!r}; run it again later."
    )


def bench(
    variants: Sequence[str] | None = None,
    *,
    preset: str = "small",
    depths: Sequence[int] | None = None,
    widths: Sequence[int] | None = None,
    seqs: Sequence[int] = (256,),
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    repeats: int = 5,
    warmup: int = 2,
    out_dir: str | os.PathLike | None = None,
    vocab: int | None = None,
    threads: int | None = None,
    steps_per_repeat: int = 1,
    seed: int = 0,
    references: bool = True,
    require_quiet: bool = False,
    log: Callable[[str], None] | None = None,
):
    """Time and memory of every variant against PreLN over a grid of depths, widths and sequence lengths.

    Returns one row per variant and shape (columns ``COLUMNS``); with ``out_dir`` also writes ``bench.csv``,
    ``bench_scaling.csv``, ``bench_meta.json`` and ``overhead_vs_<axis>.png`` there (``plot_axis``). With
    ``references`` every variant is also timed against the straightforward implementation of its own math
    (``reference_model``). The run is marked ``busy`` in its metadata when other processes kept more than
    ``quiet.OTHERS_LIMIT`` cores busy before or during it (``harness.benchmarks.quiet``); with ``require_quiet``
    a busy machine is refused before measuring, and a run that turned out busy writes nothing.
    """
    import pandas as pd

    names = resolve_variants(variants)
    counts = {"--batch-size": (batch_size, 1), "--repeats": (repeats, 1), "--warmup": (warmup, 0)}
    counts["--steps-per-repeat"] = (steps_per_repeat, 1)
    depths, widths, seqs, dtype = _checked_settings(preset, depths, widths, seqs, dtype, device, vocab, threads, counts)
    made_out_dir = out_dir is not None and not Path(out_dir).exists()
    if out_dir is not None:
        writable_dir(out_dir, "benchmark output folder")  # before the measurements, not after them
    dev = torch.device(device)

    grid = [Shape(L, d, T) for T in seqs for d in widths for L in depths]
    _check_models_build(names, grid, preset, vocab)

    old_threads = torch.get_num_threads()
    threads = threads or old_threads
    torch.set_num_threads(threads)
    load_before = quiet.loadavg()
    others_before = quiet.others_now()
    if require_quiet and quiet.is_busy(others_before):
        torch.set_num_threads(old_threads)
        _refuse_busy(others_before, out_dir if made_out_dir else None)
    run = dict(
        preset=preset,
        batch_size=batch_size,
        dtype=dtype,
        repeats=repeats,
        warmup=warmup,
        steps_per_repeat=steps_per_repeat,
        seed=seed,
        threads=threads,
        references=references,
    )
    rows = []
    try:
        with quiet.OtherLoad() as during:
            for shape in grid:
                rows += _measure_shape(names, shape, vocab=vocab, device=dev, log=log, **run)
    finally:
        torch.set_num_threads(old_threads)
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs["meta"] = _meta(df, device, load_before, others_before, during.others, run)
    if out_dir is not None:
        if require_quiet and df.attrs["meta"]["busy"]:
            _refuse_turned_busy(during.others, out_dir)
        write_outputs(df, out_dir)
    return df
