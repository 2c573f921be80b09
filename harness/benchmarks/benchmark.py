"""The cost benchmark: training-step time and peak memory of every depth mixer against PreLN, measured in one run.

For each shape (depth ``L``, width ``d``, sequence length ``T``) one model per variant is built from the same seed.
Timed forward+backward steps run interleaved, ``preln, v1, preln, v2, ..., preln`` in every repeat, so each
variant is timed between two PreLN measurements and its ratio is taken against their mean: drift from a busy
machine hits both sides of the ratio. Times are medians over repeats. Peak memory is measured once per model in
a separate step (it does not drift): on CUDA with ``torch.cuda.max_memory_allocated``, on CPU from the allocator
totals that ``torch.profiler`` records with ``profile_memory=True``; both count the model's parameters plus
everything a step allocates (activations, logits, gradients, temporaries), no optimizer state. Beside each
measurement stands the analytic floor from the variant's own cost model, and ``scaling`` fits how each variant's
extra cost grows with ``L``, ``d`` and ``T``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.benchmarks import quiet
from harness.benchmarks.memory import AllocatorPeak
from harness.config import PRESETS, ModelConfig, model_preset
from harness.errors import RunFailed, UsageError
from harness.io import atomic_write_bytes, atomic_write_json, atomic_write_text, writable_dir
from harness.model.factory import build_model
from harness.rundir import git_revision

BASELINE = "preln"
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bfloat16": "bf16"}
DEVICES = ("cpu", "cuda")

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

# Every mixer's fast path is measured beside the straightforward implementation of its own math, selected by
# ``mixer.impl``: ``"reference"`` unless the class names another in ``reference_impl`` or below. PreLN's reference
# is the plain pre-norm trunk (``PlainPreLN``).
REFERENCE = ":reference"
REFERENCE_IMPLS = {"ldm": "recurrent", "ldm-rls": "recurrent"}

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

# State streams are kept in float32 even under bf16 autocast (spec §1), so a carried float costs 4 bytes.
STATE_BYTES_PER_FLOAT = 4


@dataclass(frozen=True)
class Shape:
    """One point of the grid: depth-mixing layers, model width and sequence length."""

    depth: int
    width: int
    seq_len: int


# -- configuration ------------------------------------------------------------------------------------------


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


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward matmul FLOPs per token of the PreLN decoder (2 per multiply-add), attention scores counted in full."""
    d, f = cfg.d_model, cfg.ffn_hidden
    attention = 2 * 4 * d * d + 2 * 2 * seq_len * d  # q, k, v, o projections; then q·k and weights·v
    mlp = 2 * 3 * d * f  # gate, up and down projections of SwiGLU
    head = 2 * d * cfg.vocab_size
    return cfg.n_blocks * (attention + mlp) + head


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


def _base_name(name: str) -> str:
    return name.split("(", 1)[0]


def reference_impl(name: str, mixer) -> str | None:
    """The ``impl`` of ``mixer`` that is the straightforward form of its math, or None when it has no other."""
    if not hasattr(mixer, "impl"):
        return None
    return getattr(mixer, "reference_impl", None) or REFERENCE_IMPLS.get(_base_name(name), "reference")


class PlainPreLN(torch.nn.Module):
    """The plain pre-norm trunk a PreLN decoder is held to: ``x ← x + F_l(RMSNorm_l(x))`` written out, with no
    depth-mixing interface, on the decoder's own parameters and blocks (``F.rms_norm`` for the norms)."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, idx):
        m = self.decoder
        x = m.embed(idx)  # (b, t, d)
        for layer in m.layers:
            x = x + layer.fn(F.rms_norm(x, x.shape[-1:], layer.norm.weight, layer.norm.eps))
        return m.lm_head(F.rms_norm(x, x.shape[-1:], m.final_norm.weight, m.final_norm.eps))


def reference_model(name: str, model):
    """The straightforward implementation beside ``model`` (same weights), and the ``impl`` it runs, or None."""
    import copy

    if _base_name(name) == BASELINE:
        return PlainPreLN(model), "plain pre-norm trunk"
    impl = reference_impl(name, model.mixer)
    if impl is None or impl == model.mixer.impl:
        return None
    ref = copy.deepcopy(model)
    ref.mixer.impl = impl
    return ref, impl


# -- measurement ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_fn(model, idx, targets, dtype: str) -> Callable[[], None]:
    """One training step without an optimizer: zero the gradients, forward, cross-entropy, backward."""
    device_type = idx.device.type
    autocast = (
        (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext
    )

    def step():
        model.zero_grad(set_to_none=True)
        with autocast():
            logits = model(idx)  # (b, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()

    return step


def _time_steps(step: Callable[[], None], n_steps: int, device: torch.device) -> float:
    """Seconds per step, averaged over ``n_steps`` back-to-back steps."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(n_steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / n_steps


def static_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (tied weights counted once)."""
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def cpu_peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes live at any moment while ``fn`` runs, counting only what ``fn`` allocates (CPU allocator)."""

    # The CPU counterpart of torch.cuda.max_memory_allocated, from the profiler's allocator totals.
    peak = AllocatorPeak("cpu")
    peak.start()
    try:
        fn()
    finally:
        result = peak.stop()
    return result


@contextlib.contextmanager
def saved_activation_bytes(exclude: Iterable[torch.Tensor] = ()):
    """Count the bytes of distinct tensors autograd saves for backward inside the block (``exclude`` left out).

    Yields a dict whose ``"bytes"`` entry holds the total once the block has ended.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    result = {"bytes": 0}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t  # the hook only counts; autograd keeps the tensor as usual

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["bytes"] = sum(storages.values())


def peak_step_bytes(model, step: Callable[[], None], device: torch.device) -> tuple[int, int]:
    """(peak bytes of one training step including the model's own, bytes saved for backward)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    with saved_activation_bytes(exclude=list(model.parameters())) as saved:
        if device.type == "cuda":
            _sync(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            _sync(device)
            # Other variants' models share the device, so count only what this step added above the start.
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            peak = cpu_peak_allocated_bytes(step)
    model.zero_grad(set_to_none=True)
    return static_bytes(model) + peak, saved["bytes"]


def _floor(mixer, cfg: ModelConfig, seq_len: int) -> dict:
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

    cfg = model_config(preset, shape, vocab)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch_size, shape.seq_len + 1), generator=gen)
    idx, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (b, t) each
    models, steps, impls = {}, {}, {}
    for name in names:
        torch.manual_seed(seed)  # every variant starts from the same draw, so the decoders match
        models[name] = build_model(cfg, name).to(device).train()
        steps[name] = _step_fn(models[name], idx, targets, dtype)
        ref = reference_model(name, models[name]) if references else None
        if ref is not None:
            key = name + REFERENCE
            models[key], impls[name] = ref[0].to(device).train(), ref[1]
            steps[key] = _step_fn(models[key], idx, targets, dtype)
    timed = list(models)

    for _ in range(warmup):
        for name in timed:
            steps[name]()
            models[name].zero_grad(set_to_none=True)

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
                measured.append((name, _time_steps(steps[name], steps_per_repeat, device)))
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
        if log:
            log(f"  {shape}: repeat {r + 1}/{repeats} done")

    memory = {}
    for name in timed:
        memory[name] = peak_step_bytes(models[name], steps[name], device)

    rows = []
    base_mem = memory[BASELINE][0]
    for name in names:
        step_s = statistics.median(times[name])
        ratio_time = 1.0 if name == BASELINE else statistics.median(ratios[name])
        mem, saved = memory[name]
        ratio_mem = mem / base_mem
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
                **_floor(models[name].mixer, cfg, shape.seq_len),
                "target": target,
                "met": met,
                **ref,
            }
        )
    del models, steps
    gc.collect()
    return rows


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
    if preset not in PRESETS:
        model_preset(preset)
    base = PRESETS[preset]
    depths = _positive_ints("--depths", depths or (2 * base["n_blocks"],), even=True)
    widths = _positive_ints("--widths", widths or (base["d_model"],))
    seqs = _positive_ints("--seq", seqs)
    for label, value, least in (
        ("--batch-size", batch_size, 1),
        ("--repeats", repeats, 1),
        ("--warmup", warmup, 0),
        ("--steps-per-repeat", steps_per_repeat, 1),
    ):
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
    made_out_dir = out_dir is not None and not Path(out_dir).exists()
    if out_dir is not None:
        writable_dir(out_dir, "benchmark output folder")  # before the measurements, not after them
    dev = torch.device(device)

    import variants as registry

    grid = [Shape(L, d, T) for T in seqs for d in widths for L in depths]
    for shape in grid:  # every model must build before anything is timed
        cfg = model_config(preset, shape, vocab)
        for name in names:
            registry.validate(name, d_model=cfg.d_model, n_layers=cfg.n_layers)

    old_threads = torch.get_num_threads()
    threads = threads or old_threads
    torch.set_num_threads(threads)
    load_before = _loadavg()
    others_before = quiet.others_now()
    if require_quiet and quiet.is_busy(others_before):
        torch.set_num_threads(old_threads)
        if made_out_dir and not any(Path(out_dir).iterdir()):
            Path(out_dir).rmdir()  # a refused run leaves nothing behind, not even its empty folder
        raise RunFailed(
            f"The machine is busy (other processes keep {others_before:.2f} of its {os.cpu_count()} CPUs busy, "
            f"more than {quiet.OTHERS_LIMIT}): reference numbers need a quiet machine; try again later."
        )
    rows = []
    try:
        with quiet.OtherLoad() as during:
            for shape in grid:
                if log:
                    log(
                        f"measuring {len(names)} variants at depth {shape.depth}, width {shape.width}, "
                        f"seq {shape.seq_len} on {device} with {threads} threads"
                    )
                rows += _measure_shape(
                    names,
                    shape,
                    preset=preset,
                    vocab=vocab,
                    batch_size=batch_size,
                    device=dev,
                    dtype=dtype,
                    repeats=repeats,
                    warmup=warmup,
                    steps_per_repeat=steps_per_repeat,
                    seed=seed,
                    threads=threads,
                    references=references,
                    log=log,
                )
    finally:
        torch.set_num_threads(old_threads)
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs["meta"] = {
        "preset": preset,
        "vocab_size": int(df["vocab_size"].iloc[0]),
        "threads": threads,
        "device": device,
        "dtype": dtype,
        "batch_size": batch_size,
        "repeats": repeats,
        "warmup": warmup,
        "steps_per_repeat": steps_per_repeat,
        "seed": seed,
        "torch": torch.__version__,
        "git_revision": git_revision(),  # the code measured, for before/after comparisons across commits
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        # Cores other processes kept busy, in the second before and on average during the run (quiet.py).
        "others_before": others_before,
        "others_during": during.others,
        "busy": quiet.is_busy(others_before, during.others),
        "references": references,
        "gpu": torch.cuda.get_device_name(dev) if device == "cuda" else "",
        "memory_method": (
            "torch.cuda.max_memory_allocated"
            if device == "cuda"
            else "torch.profiler allocator totals (profile_memory=True)"
        ),
    }
    if out_dir is not None:
        if require_quiet and df.attrs["meta"]["busy"]:
            raise RunFailed(
                f"The machine became busy during the run (other processes kept {during.others:.2f} of its "
                f"{os.cpu_count()} CPUs busy on average, more than {quiet.OTHERS_LIMIT}): nothing was written to "
                f"{str(out_dir)!r}; run it again later."
            )
        write_outputs(df, out_dir)
    return df


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# -- analysis and output -------------------------------------------------------------------------------------

AXES = (("depth", "L"), ("width", "d"), ("seq_len", "T"))


def _fit_exponents(rows, column: str) -> tuple[dict[str, float], int]:
    """Least-squares exponents of ``column`` against the varied axes on log-log scales (positive values only)."""
    import numpy as np

    varied = [axis for axis, _ in AXES if rows[axis].nunique() > 1]
    usable = rows[rows[column] > 0]
    if not varied or len(usable) < len(varied) + 1:
        return {axis: math.nan for axis, _ in AXES}, len(usable)
    x = np.column_stack([np.ones(len(usable))] + [np.log(usable[a].to_numpy(float)) for a in varied])
    y = np.log(usable[column].to_numpy(float))
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    fitted = dict(zip(varied, coef[1:]))
    return {axis: float(fitted.get(axis, math.nan)) for axis, _ in AXES}, len(usable)


def scaling(df):
    """Per variant, exponents ``a`` with extra cost ∝ L^a_L · d^a_d · T^a_T, fitted log-log over the grid."""
    import pandas as pd

    out = []
    for name, rows in df[df["variant"] != BASELINE].groupby("variant", sort=False):
        t_exp, n_t = _fit_exponents(rows, "extra_time_ms")
        m_exp, n_m = _fit_exponents(rows, "extra_mem_bytes")
        row = {"variant": name, "points": len(rows), "time_points": n_t, "mem_points": n_m}
        row.update({f"time_exp_{a}": v for a, v in t_exp.items()})
        row.update({f"mem_exp_{a}": v for a, v in m_exp.items()})
        out.append(row)
    columns = ["variant", "points", "time_points", "mem_points"] + [
        f"{k}_exp_{a}" for k in ("time", "mem") for a, _ in AXES
    ]
    return pd.DataFrame(out, columns=columns)


def scaling_lines(fits) -> list[str]:
    """One sentence per variant: how its extra time and extra memory grow with L, d and T."""

    def law(row, kind):
        parts = [
            f"{sym}^{row[f'{kind}_exp_{axis}']:.2f}" for axis, sym in AXES if not math.isnan(row[f"{kind}_exp_{axis}"])
        ]
        return " · ".join(parts) if parts else "n/a (needs two values of an axis and a positive extra cost)"

    return [
        f"{row['variant']}: extra time ∝ {law(row, 'time')}; extra memory ∝ {law(row, 'mem')}"
        for _, row in fits.iterrows()
    ]


def format_table(df) -> str:
    """The measurements as a fixed-width table with the analytic floor and the target beside each ratio."""
    view = df.assign(
        peak_mem_MiB=df["peak_mem_bytes"] / 2**20,
        state_B_per_tok=df["floor_state_bytes_per_token"],
    )[
        [
            "variant",
            "depth",
            "width",
            "seq_len",
            "step_time_ms",
            "tokens_per_s",
            "peak_mem_MiB",
            "ratio_time",
            "ratio_time_iqr",
            "ratio_mem",
            "floor_time_ratio",
            "state_B_per_tok",
            "target",
            "met",
            "ref_impl",
            "ratio_time_vs_ref",
            "ratio_mem_vs_ref",
            "vs_ref",
        ]
    ]
    return view.to_string(index=False, float_format=lambda x: f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}")


AXIS_LABELS = {"depth": "depth L", "width": "width d", "seq_len": "sequence length T"}
AXIS_SYMBOLS = {"depth": "L", "width": "d", "seq_len": "T"}


def plot_axis(df) -> str:
    """The grid axis a plot runs along: depth when it varies (or when nothing does), else width, else T."""
    for axis in ("depth", "width", "seq_len"):
        if df[axis].nunique() > 1:
            return axis
    return "depth"


def plot_overhead(df, path: str | os.PathLike) -> Path:
    """Ratio to PreLN (time and memory) against the varying axis (``plot_axis``), one line per variant, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    axis = plot_axis(df)
    long = df.melt(
        id_vars=["variant", "depth", "width", "seq_len"],
        value_vars=["ratio_time", "ratio_mem"],
        var_name="metric",
        value_name="ratio to preln",
    )
    others = [a for a in AXIS_SYMBOLS if a != axis]  # the fixed axes label each line's shape, e.g. "d=256, T=128"
    long["shape"] = long.apply(lambda r: ", ".join(f"{AXIS_SYMBOLS[a]}={r[a]}" for a in others), axis=1)
    several = long["shape"].nunique() > 1
    grid = sns.relplot(
        data=long,
        x=axis,
        y="ratio to preln",
        hue="variant",
        col="metric",
        kind="line",
        marker="o",
        style="shape" if several else None,
        height=3.6,
        aspect=1.2,
        facet_kws={"sharey": False},
    )
    grid.set_titles("{col_name}")
    values = sorted(df[axis].unique())
    for ax in grid.axes.flat:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if len(values) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.set_xlabel(AXIS_LABELS[axis])
        ax.minorticks_off()
    grid.figure.suptitle(f"Overhead over PreLN against {AXIS_LABELS[axis]}", y=1.03)
    buf = io.BytesIO()
    grid.figure.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(grid.figure)

    return atomic_write_bytes(path, buf.getvalue())


def write_outputs(df, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the CSV, the scaling fits, the run's settings and the plot into ``out_dir``."""

    out = Path(out_dir)
    paths = {
        "csv": atomic_write_text(out / "bench.csv", df.to_csv(index=False)),
        "scaling": atomic_write_text(out / "bench_scaling.csv", scaling(df).to_csv(index=False)),
        "meta": atomic_write_json(out / "bench_meta.json", df.attrs.get("meta", {})),
        "plot": plot_overhead(df, out / f"overhead_vs_{plot_axis(df)}.png"),
    }
    return paths
