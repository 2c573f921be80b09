"""The prepared GPU check (``make gpu-bench``): everything the speed targets are judged on, in one run on one card,
into one folder.

1. ``depthmem selftest`` on the card (every variant's numerics against the float64 CPU reference, training falls).
2. Every variant's training step (forward, loss, backward) at ``gpt2-small``, T = 1024, bf16, at 24 and 48
   sublayers, eager and compiled (``fullgraph=True``), with the fused kernels on; compiled also with them off.
   Each row: milliseconds, ratio to ``preln`` in the same mode, peak memory and its ratio, and from the profiler
   the GPU kernels launched and the host synchronisations (``aten::item``/``_local_scalar_dense``) per step.
3. ``preln`` compiled at growing micro batches: tokens/s and the fraction of the card's bf16 peak, up to the
   largest that fits.
4. ``depthmem bench --loop`` on the card: the harness's training loop against a bare loop.

``python -m harness.benchmarks.gpu --out results/gpu-bench`` runs it; ``--quick`` is a smoke run of the same code
at the ``tiny`` preset (on CPU too). The tables go to ``steps.csv``, ``micro_batch.csv`` and ``gpu-bench.md``.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from harness.benchmarks.benchmark import Shape, model_config, resolve_variants
from harness.benchmarks.selftest import card_peak_tflops
from harness.benchmarks.timing import step_fn, sync, time_steps
from harness.config import PRESETS
from harness.io import atomic_write_text
from harness.model.costs import preln_flops_per_token
from harness.model.factory import build_model
from variants import kernels

SYNCS = ("aten::item", "aten::_local_scalar_dense")


def _profile_counts(step, device: torch.device) -> tuple[int | None, int]:
    """GPU kernels launched (None on CPU) and host synchronisations in one step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.events()
    syncs = sum(1 for e in events if e.name in SYNCS)
    if device.type != "cuda":
        return None, syncs
    gpu = sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return gpu, syncs


def step_rows(
    variants, depths, *, preset, seq_len, batch, device, dtype, repeats, log, deadline, backend="inductor"
) -> list[dict]:
    """One row per depth, mode and variant; rows past ``deadline`` (a ``time.monotonic()``) are marked skipped, so
    the whole check keeps to its time on the card."""
    rows = []
    for depth in depths:
        cfg = model_config(preset, Shape(depth, PRESETS[preset]["d_model"], seq_len))
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(cfg.vocab_size, (batch, seq_len + 1), generator=gen)
        idx, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        modes = [("eager", False, "auto"), ("compiled", True, "auto")]
        if depth == depths[0]:  # what the kernels add over inductor alone, at the first depth
            modes.append(("compiled, kernels off", True, "off"))
        for mode, compiled, kernel_mode in modes:
            for name in variants:
                if time.monotonic() > deadline:
                    rows.append({"depth": depth, "mode": mode, "variant": name, "error": "skipped: time budget"})
                    continue
                kernels.set_mode(kernel_mode)
                torch.manual_seed(0)
                model = build_model(cfg, name).to(device).train()
                forward = torch.compile(model, fullgraph=True, backend=backend) if compiled else model
                step = step_fn(forward, idx, targets, dtype)
                try:
                    started = time.perf_counter()
                    step()  # compiles, where it does
                    first_s = time.perf_counter() - started
                    step()
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    times = [time_steps(step, 1, device) for _ in range(repeats)]
                    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
                    n_kernels, syncs = _profile_counts(step, device)
                    row = {"ms": statistics.median(times) * 1e3, "first_step_s": first_s, "peak_bytes": peak}
                    row.update(kernels_per_step=n_kernels, syncs_per_step=syncs, error="")
                except Exception as e:  # a variant that fails to compile is a finding, not the end of the run
                    row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                rows.append({"depth": depth, "mode": mode, "variant": name, **row})
                log(f"L={depth} {mode:>21} {name:<16} " + (f"{row['ms']:.1f} ms" if "ms" in row else row["error"]))
                del model, forward, step
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
    kernels.set_mode("auto")
    return rows


def micro_batch_rows(*, preset, seq_len, device, dtype, batches, repeats, log, backend="inductor") -> list[dict]:
    base = PRESETS[preset]
    cfg = model_config(preset, Shape(2 * base["n_blocks"], base["d_model"], seq_len))
    peak = card_peak_tflops(device)
    rows = []
    for batch in batches:
        torch.manual_seed(0)
        model = build_model(cfg, "preln").to(device).train()
        tokens = torch.randint(cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
        step = step_fn(
            torch.compile(model, fullgraph=True, backend=backend),
            tokens[:, :-1].to(device),
            tokens[:, 1:].to(device),
            dtype,
        )
        try:
            step()
            step()
            sec = statistics.median(time_steps(step, 1, device) for _ in range(repeats))
        except torch.OutOfMemoryError:
            log(f"preln micro batch {batch}: out of memory")
            break
        finally:
            del model
        tokens_per_s = batch * seq_len / sec
        tflops = 3 * preln_flops_per_token(cfg, seq_len) * tokens_per_s / 1e12
        rows.append(
            {
                "batch": batch,
                "ms": sec * 1e3,
                "tokens_per_s": tokens_per_s,
                "tflops": tflops,
                "peak_fraction": None if peak is None else tflops / peak,
            }
        )
        log(f"preln micro batch {batch}: {tokens_per_s:,.0f} tokens/s, {tflops:.1f} TFLOP/s")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return rows


def _with_ratios(rows: list[dict]):
    import pandas as pd

    frame = pd.DataFrame(rows)
    if "ms" not in frame:
        return frame
    base = frame[frame.variant == "preln"].set_index(["depth", "mode"])
    key = list(zip(frame.depth, frame["mode"]))
    frame["time_ratio"] = [ms / base.ms.get(k, float("nan")) for ms, k in zip(frame.ms, key)]
    if frame.peak_bytes.notna().any():
        frame["memory_ratio"] = [b / base.peak_bytes.get(k, float("nan")) for b, k in zip(frame.peak_bytes, key)]
    return frame


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu-bench", help="the folder everything goes to")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny preset, short sequences, one depth")
    parser.add_argument("--variants", default="", help="comma-separated variants (default: all registered)")
    parser.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend (default: inductor; aot_eager checks the graph only)",
    )
    parser.add_argument("--skip-selftest", action="store_true")
    parser.add_argument("--skip-loop", action="store_true")
    parser.add_argument(
        "--minutes", type=float, default=7.5, help="time budget: step rows past it are skipped (default: 7.5)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("depthmem: --device cuda asked for, but this machine has no CUDA GPU.", file=sys.stderr)
        return 2
    preset, seq, batch, depths, repeats = (
        ("tiny", 64, 4, [4], 2) if args.quick else ("gpt2-small", 1024, 8, [24, 48], 5)
    )
    dtype = "bf16" if device.type == "cuda" else "float32"
    lines: list[str] = []
    started = time.monotonic()
    # The step table gets what the selftest, the micro batches and the loop (about 2.5 minutes) leave of the budget.
    reserve = 0.0 if args.quick else 150.0

    def log(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    log(f"card: {card}; torch {torch.__version__}; preset {preset}, T = {seq}, batch {batch}, {dtype}")
    cli = [sys.executable, "-m", "harness.cli"]
    if not args.skip_selftest:
        quick = ["--check-preset", "tiny", "--train-preset", "tiny", "--bench-preset", "tiny", "--bench-seq", "32"]
        quick = quick if args.quick else []
        done = subprocess.run([*cli, "selftest", "--device", args.device, "--out", str(out / "selftest"), *quick])
        log(f"selftest: exit {done.returncode}")
    steps = _with_ratios(
        step_rows(
            # Commas inside a variant's knobs, ldm-rls(groups=4,lambda=1.0), do not split it.
            resolve_variants([v for v in re.split(r",(?![^()]*\))", args.variants) if v.strip()] or None),
            depths,
            preset=preset,
            seq_len=seq,
            batch=batch,
            device=device,
            dtype=dtype,
            repeats=repeats,
            log=log,
            deadline=started + args.minutes * 60 - reserve,
            backend=args.backend,
        )
    )
    steps.to_csv(out / "steps.csv", index=False)
    import pandas as pd

    micro = pd.DataFrame(
        micro_batch_rows(
            preset=preset,
            seq_len=seq,
            device=device,
            dtype=dtype,
            batches=[4, 8] if args.quick else [8, 16, 32, 64],
            repeats=repeats,
            log=log,
            backend=args.backend,
        )
    )
    micro.to_csv(out / "micro_batch.csv", index=False)
    if not args.skip_loop:
        loop = ["--preset", "tiny", "--steps", "11"] if args.quick else ["--preset", "small", "--steps", "31"]
        done = subprocess.run([*cli, "bench", "--loop", "--device", args.device, *loop, "--out", str(out / "loop")])
        log(f"bench --loop: exit {done.returncode}")
    report = [
        f"# GPU bench: {card}, torch {torch.__version__}",
        "",
        f"`{preset}`, T = {seq}, batch {batch}, {dtype}; medians of {repeats} steps; ratios to `preln` in one mode.",
        "",
        steps.to_markdown(index=False, floatfmt=".3g"),
        "",
        "## `preln` compiled, by micro batch",
        "",
        micro.to_markdown(index=False, floatfmt=".3g") if len(micro) else "(none fitted)",
        "",
        "## Log",
        "",
        "```",
        *lines,
        "```",
        "",
    ]
    atomic_write_text(out / "gpu-bench.md", "\n".join(report))
    print(f"depthmem: wrote {out / 'gpu-bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
