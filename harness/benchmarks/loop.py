"""What the training harness costs: tokens/s of ``depthmem train`` against a bare PyTorch loop on the same work.

The bare loop is what the harness wraps, written out: the same model built through the Python API from the same
seed, AdamW with the same hyperparameters, gradient clipping and learning-rate schedule, the same batches of the
same data (``harness.data.corpus.train_batch`` keyed by seed and step), and nothing else. The harness run is
``harness.training.trainer.train`` (what ``depthmem train`` calls) with its logging, status file, checkpoints and
validation at the intervals given. Both are timed over steps ``2 .. steps`` (the first step of each carries the
warm-up, and the harness's validation at step 0 before it): the harness from the running rate it logs in
``metrics.csv`` (its logged intervals tile that time exactly), the bare loop by the clock around the same steps.
Every event the harness fires at a step below ``steps`` (validation, per-layer diagnostics, checkpoint) falls in the
timed span, so with ``steps = k·val_every + 1`` it is counted at its real frequency.

The loops run in the order bare, harness, bare (``rounds`` times: bare, harness, bare, harness, bare, ...) in
one process and each harness run is taken against the mean of the two bare runs around it, so a drift of the
machine hits both sides; ``bare_spread`` says how far the bare runs differ among themselves, the resolution of
``harness_cost``. The CPU time other processes used, in the second before a variant's runs and during them, is
recorded (``harness.benchmarks.quiet``); a row where it passed ``quiet.OTHERS_LIMIT`` cores is marked ``busy``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.benchmarks import quiet
from harness.config import build_config
from harness.data import corpus as datalib
from harness.errors import UsageError
from harness.io import atomic_write_text
from harness.model.factory import build_model

COLUMNS = [
    "variant",
    "preset",
    "steps",
    "timed_steps",
    "batch_size",
    "seq_len",
    "log_every",
    "val_every",
    "val_batches",
    "ckpt_every",
    "bare_tokens_per_s",
    "bare_tokens_per_s_after",
    "harness_tokens_per_s",
    "harness_cost",
    "rounds",
    "bare_spread",
    "harness_wall_s",
    "threads",
    "loadavg_before",
    "loadavg_after",
    "others_before",
    "others_during",
    "busy",
]


def _folder(name: str) -> str:
    return name.replace("(", "_").replace(")", "_")


def run_config(
    variant: str,
    preset: str,
    *,
    steps: int,
    log_every: int,
    val_every: int,
    val_batches: int,
    ckpt_every: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    device: str = "cpu",
):
    return build_config(
        {
            "model": {"preset": preset},
            "variant": variant,
            "train": {
                "max_steps": steps,
                "log_every_steps": log_every,
                "val_every_steps": val_every,
                "val_batches": val_batches,
                "ckpt_every_steps": ckpt_every,
                "batch_size": batch_size,
                "seq_len": seq_len,
                "seed": seed,
                "accelerator": "gpu" if device == "cuda" else "cpu",
            },
        }
    )


def bare_loop(cfg, steps: int) -> float:
    """Seconds of steps ``2 .. steps`` of the plain loop: forward, loss, backward, clip, AdamW, schedule."""
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.training.budget import seq_len_of
    from harness.training.optim import compiles, lr_factor, on_gpu

    t = cfg.train
    tokens = datalib.load_tokens(cfg, datalib.get_tokenizer(cfg)).train
    torch.manual_seed(t.seed)
    # What the harness does on the same device: bf16 autocast on a GPU (precision auto), compiled where it compiles.
    dev = torch.device("cuda" if on_gpu(cfg) else "cpu")
    model = build_model(cfg.model, cfg.variant).to(dev).train()
    forward = torch.compile(model, fullgraph=True) if compiles(cfg) else model
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" else contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_factor(
            s,
            total=steps,
            warmup=t.warmup_steps,
            schedule=t.schedule,
            min_ratio=t.min_lr_ratio,
            decay_fraction=t.decay_fraction,
        ),
    )
    seq_len = seq_len_of(cfg)
    start = None
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()
        batch = torch.from_numpy(
            datalib.train_batch(tokens, seed=t.seed, step=step, batch_size=t.batch_size, seq_len=seq_len)
        ).to(dev)  # (b, t + 1)
        with autocast():
            logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        float(loss.detach())  # the loop reads its loss once per step, as any loop that reports one does
    return time.perf_counter() - start


def harness_loop(cfg, run_dir: Path) -> tuple[float, float]:
    """(seconds of steps ``2 .. steps`` from the logged rates of ``train``, the run's whole wall time)."""
    import csv

    from harness.training.budget import seq_len_of
    from harness.training.trainer import train

    started = time.perf_counter()
    train(cfg, run_dir, resume=False)
    wall = time.perf_counter() - started
    per_step = cfg.train.batch_size * seq_len_of(cfg)
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["tokens_per_s"]]
    seconds, last = 0.0, 1
    for r in rows:
        step = int(r["step"])
        if step > 1:
            seconds += (step - last) * per_step / float(r["tokens_per_s"])
            last = step
    return seconds, wall


def _check_loop_settings(counts: dict, threads: int | None, device: str) -> None:
    for label, (value, least) in counts.items():
        if int(value) != value or value < least:
            raise UsageError(f"{label} must be an integer of at least {least}, got {value}.")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be a positive integer, got {threads}.")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but this machine has no CUDA GPU; use --device cpu.")


def _loop_configs(variants: Sequence[str], preset: str, seq_len: int, **settings) -> dict:
    """The run config of each variant, once the sequence fits the preset."""
    cfgs = {}
    for name in variants:
        cfg = run_config(name, preset, seq_len=seq_len, **settings)
        if seq_len > cfg.model.max_seq_len:
            raise UsageError(
                f"--seq must not exceed the preset's max_seq_len ({cfg.model.max_seq_len}), got {seq_len}."
            )
        cfgs[name] = cfg
    return cfgs


def _time_variant(name: str, cfg, steps: int, rounds: int, tmp: str, log) -> dict:
    """Bare and harness run times of one variant, alternating, and how busy the machine was meanwhile."""
    load_before, others_before = quiet.loadavg(), quiet.others_now()
    if log:
        log(f"{name}: bare loop, {steps} steps (other processes: {others_before} cores busy)")
    with quiet.OtherLoad() as during:
        bares, harnesses, wall = [bare_loop(cfg, steps)], [], 0.0
        for r in range(rounds):
            if log:
                log(f"{name}: depthmem train, {steps} steps (round {r + 1}/{rounds})")
            seconds, wall = harness_loop(cfg, Path(tmp) / f"{_folder(name)}-{r}")
            harnesses.append(seconds)
            if log:
                log(f"{name}: bare loop again")
            bares.append(bare_loop(cfg, steps))
    return {
        "bares": bares,
        "harnesses": harnesses,
        "harness_wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": quiet.loadavg(),
        "others_before": others_before,
        "others_during": during.others,
        "busy": quiet.is_busy(others_before, during.others),
    }


def _cost_columns(timed: dict, tokens: int) -> dict:
    """Token rates of the bare and harness runs, and the harness's cost over the bare loop."""
    bares, harnesses = timed["bares"], timed["harnesses"]
    # Each harness run against the mean of the two bare runs around it; the median over rounds.
    costs = [h / ((bares[r] + bares[r + 1]) / 2) - 1 for r, h in enumerate(harnesses)]
    return {
        "bare_tokens_per_s": tokens / statistics.median(bares[:-1]),
        "bare_tokens_per_s_after": tokens / statistics.median(bares[1:]),
        "harness_tokens_per_s": tokens / statistics.median(harnesses),
        # The harness's time over the mean time of the two bare runs around it, minus 1.
        "harness_cost": statistics.median(costs),
        # How far the bare runs themselves spread, over their mean: the resolution of the cost.
        "bare_spread": (max(bares) - min(bares)) / statistics.mean(bares),
    }


def loop_bench(
    variants: Sequence[str] = ("preln", "ldm-rls"),
    *,
    preset: str = "small",
    steps: int = 51,
    log_every: int = 10,
    val_every: int = 50,
    val_batches: int = 3,
    ckpt_every: int = 50,
    batch_size: int = 8,
    seq_len: int = 256,
    seed: int = 0,
    threads: int | None = None,
    rounds: int = 1,
    out_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
    device: str = "cpu",
):
    """Harness against bare-loop tokens/s for each variant; one row per variant (columns ``COLUMNS``). On
    ``device`` ``cuda`` both train on the GPU, in bf16 autocast and compiled, as ``train.precision`` and
    ``train.compile`` default to there.

    ``rounds`` harness runs alternate with ``rounds + 1`` bare runs (bare, harness, bare, ...); ``harness_cost`` is
    the median over rounds of each harness run's time over the mean of its two neighbours, minus 1."""
    import pandas as pd

    counts = {"--steps": (steps, 3), "--repeats": (rounds, 1), "--log-every": (log_every, 1)}
    counts |= {"--val-every": (val_every, 1), "--val-batches": (val_batches, 0), "--ckpt-every": (ckpt_every, 1)}
    counts |= {"--batch-size": (batch_size, 1), "--seq": (seq_len, 2)}
    _check_loop_settings(counts, threads, device)
    every = {"log_every": log_every, "val_every": val_every, "val_batches": val_batches, "ckpt_every": ckpt_every}
    cfgs = _loop_configs(
        variants, preset, seq_len, steps=steps, batch_size=batch_size, seed=seed, device=device, **every
    )
    old_threads = torch.get_num_threads()
    threads = threads or old_threads
    torch.set_num_threads(threads)
    rows = []
    tokens = (steps - 1) * batch_size * seq_len
    try:
        with tempfile.TemporaryDirectory(prefix="depthmem-loop-") as tmp:
            for name, cfg in cfgs.items():
                timed = _time_variant(name, cfg, steps, rounds, tmp, log)
                rows.append(
                    {
                        "variant": cfg.variant,
                        "preset": preset,
                        "steps": steps,
                        "timed_steps": steps - 1,
                        "batch_size": batch_size,
                        "seq_len": seq_len,
                        **every,
                        **_cost_columns(timed, tokens),
                        "rounds": rounds,
                        "threads": threads,
                        **{k: v for k, v in timed.items() if k not in ("bares", "harnesses")},
                    }
                )
    finally:
        torch.set_num_threads(old_threads)
    df = pd.DataFrame(rows, columns=COLUMNS)
    if out_dir is not None:
        atomic_write_text(Path(out_dir) / "loop_bench.csv", df.to_csv(index=False))
    return df


def format_table(df) -> str:
    view = df[
        [
            "variant",
            "timed_steps",
            "bare_tokens_per_s",
            "bare_tokens_per_s_after",
            "harness_tokens_per_s",
            "harness_cost",
            "bare_spread",
            "harness_wall_s",
            "others_before",
            "others_during",
            "busy",
        ]
    ]
    return view.to_string(index=False, float_format=lambda x: f"{x:.3f}" if abs(x) < 10 else f"{x:.0f}")


__all__ = ["loop_bench", "bare_loop", "harness_loop", "format_table", "COLUMNS"]
