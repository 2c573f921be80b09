"""``depthmem bench``: step time and peak memory of every depth mixer against PreLN, with floors and targets."""

from __future__ import annotations

import sys

from harness.errors import UsageError
from harness.io import atomic_write_text

# --quick: the smallest run that still exercises every variant and every output file.
QUICK = dict(preset="tiny", depths=[4], seqs=[32], batch_size=2, repeats=1, warmup=1)


def _int_list(flag: str, text: str | None) -> list[int] | None:
    """``"8,16,32"`` as integers; parsed here rather than by argparse so a mistake is a UsageError (exit 2)."""
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise UsageError(f"{flag} takes comma-separated integers such as 8,16,32, got {text!r}.")
    return values


def variant_list(text: str) -> list[str]:
    # Knobs contain commas too (ldm-rls(groups=4,lambda=1.0)), so split only outside parentheses.
    out, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    out.append(current.strip())
    return [v for v in out if v]


def add_parser(sub):
    p = sub.add_parser(
        "bench",
        help="time and memory of every variant against preln",
        description="Measure forward+backward step time, tokens/s and peak memory of each variant, "
        "interleaved with preln in one process, with the analytic floor, the targets "
        "and how each cost grows with depth, width and sequence length.",
    )
    p.add_argument(
        "--variants",
        type=variant_list,
        default=None,
        help="comma-separated variant names with optional knobs (default: all registered)",
    )
    p.add_argument("--preset", default=None, help="model preset (default: small)")
    p.add_argument(
        "--depths", default=None, help="depth-mixing layers L, even, comma-separated (default: the preset's)"
    )
    p.add_argument("--widths", default=None, help="model widths d, comma-separated (default: the preset's)")
    p.add_argument("--seq", default=None, help="sequence lengths (default: 256)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 8)")
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="vocabulary size; the preset's GPT-2 50257 makes the LM head dominate at small width",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 or bf16 (autocast); default float32, bf16 with --micro-batch-memory",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds over all variants (default: 5; with --loop: harness runs, each between two "
        "bare runs, default 1)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per model first (default: 2)")
    p.add_argument("--steps-per-repeat", type=int, default=1, help="steps averaged in one timing (default: 1)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for the whole run (default: torch's current setting)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens (default: 0)")
    p.add_argument("--out", default="results/bench", help="folder for bench.csv and the plot")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: tiny preset, one depth, one repeat (explicit flags still win)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="measure what torch.compile gains instead: each variant's step eager and compiled, "
        "at the first sequence length (writes compile.csv)",
    )
    p.add_argument(
        "--no-references",
        action="store_true",
        help="skip timing each variant against the straightforward implementation of its own math",
    )
    p.add_argument(
        "--require-quiet",
        action="store_true",
        help="refuse to start on a busy machine, and write nothing if it became busy (reference numbers)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the resolved settings and exit")
    _add_fit_and_loop_options(p)
    return p


def _add_fit_and_loop_options(p) -> None:
    """The options of the two other measurements: what fits a card, and the training loop against a bare one."""
    fit = p.add_argument_group("what fits a card (--micro-batch-memory)")
    fit.add_argument(
        "--micro-batch-memory",
        action="store_true",
        help="instead: peak memory of a whole AdamW training step at each micro batch, the line through them, "
        "and the largest micro batch per card size (defaults: gpt2-small, seq 1024, bf16)",
    )
    fit.add_argument("--micro-batches", default="1,2", help="micro batches to measure (default: 1,2)")
    fit.add_argument("--cards", default="40,80", help="card sizes in GiB to fit (default: 40,80)")
    fit.add_argument(
        "--headroom", type=float, default=0.15, help="share of the card left to CUDA, NCCL and the allocator"
    )
    loop = p.add_argument_group("training loop (--loop)")
    loop.add_argument(
        "--loop",
        action="store_true",
        help="instead: tokens/s of depthmem train against a bare PyTorch loop on the same work "
        "(default variants preln,ldm-rls)",
    )
    loop.add_argument("--steps", type=int, default=51, help="optimizer steps per loop (default: 51)")
    loop.add_argument("--log-every", type=int, default=10, help="harness logging interval (default: 10)")
    loop.add_argument("--val-every", type=int, default=50, help="harness validation interval (default: 50)")
    loop.add_argument("--val-batches", type=int, default=3, help="batches per validation (default: 3)")
    loop.add_argument("--ckpt-every", type=int, default=50, help="harness checkpoint interval (default: 50)")


def _run_compile(args, settings) -> int:
    from pathlib import Path

    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.benchmarks.compile import compile_gain

    df = compile_gain(
        settings["variants"],
        preset=settings["preset"],
        seq_len=settings["seqs"][0],
        batch_size=settings["batch_size"],
        device=settings["device"],
        dtype=settings["dtype"],
        repeats=settings["repeats"],
        warmup=settings["warmup"],
        seed=settings["seed"],
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    meta = df.attrs["meta"]
    print(
        f"torch.compile against eager: preset {meta['preset']}, seq {meta['seq_len']}, batch {meta['batch_size']}, "
        f"{meta['device']} {meta['dtype']}, {meta['threads']} threads, median of {meta['repeats']} alternating steps"
    )
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "compile.csv", df.to_csv(index=False))
    print(f"\nwrote {out}/compile.csv")
    return 0


def _print_settings(settings: dict) -> int:
    """What --dry-run prints: the resolved settings, one per line."""
    for key, value in settings.items():
        print(f"{key}: {value}")
    return 0


def run_micro_batch(args) -> int:
    from pathlib import Path

    micro = _int_list("--micro-batches", args.micro_batches)
    cards = _int_list("--cards", args.cards)
    seqs = _int_list("--seq", args.seq) or [1024]
    if len(set(micro)) < 2 or min(micro) < 1:
        raise UsageError(f"--micro-batches needs two or more distinct positive sizes, got {args.micro_batches!r}.")
    if len(seqs) != 1:
        raise UsageError(f"--micro-batch-memory takes one sequence length, got {args.seq!r}.")
    if not 0 <= args.headroom < 1:
        raise UsageError(f"--headroom must be in [0, 1), got {args.headroom}.")
    dtype = args.dtype or "bf16"
    if dtype not in ("float32", "bf16"):
        raise UsageError(f"--dtype must be float32 or bf16, got {dtype!r}.")
    settings = dict(
        variants=args.variants, preset=args.preset or "gpt2-small", seq_len=seqs[0], micro_batches=micro,
        dtype=dtype, device=args.device, seed=args.seed,
    )  # fmt: skip
    if args.dry_run:
        return _print_settings({**settings, "cards": cards, "headroom": args.headroom})
    from harness.benchmarks import micro_batch as MB

    df = MB.micro_batch_memory(**settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    table = MB.fit_table(df, cards, args.headroom)
    meta = df.attrs["meta"]
    print(
        f"one AdamW step, preset {meta['preset']}, seq {meta['seq_len']}, {meta['dtype']} on {meta['device']}; "
        f"fits_*: the largest micro batch with {args.headroom:.0%} of the card and DDP's gradient buckets aside"
    )
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "micro_batch.csv", df.to_csv(index=False))
    atomic_write_text(out / "micro_batch_fit.csv", table.to_csv(index=False))
    print(f"\nwrote {out}/micro_batch.csv and micro_batch_fit.csv")
    return 0


def run_loop(args) -> int:
    from harness.benchmarks import loop as LB

    seqs = _int_list("--seq", args.seq) or [256]
    if len(seqs) != 1:
        raise UsageError(f"--loop takes one sequence length, got {args.seq!r}.")
    settings = dict(
        variants=args.variants or ["preln", "ldm-rls"],
        preset=args.preset or "small",
        steps=args.steps,
        log_every=args.log_every,
        val_every=args.val_every,
        val_batches=args.val_batches,
        ckpt_every=args.ckpt_every,
        batch_size=args.batch_size or 8,
        seq_len=seqs[0],
        seed=args.seed,
        threads=args.threads,
        rounds=1 if args.repeats is None else args.repeats,
        out_dir=args.out,
        device=args.device,
    )
    if args.dry_run:
        return _print_settings(settings)
    df = LB.loop_bench(**settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(
        f"harness (depthmem train) against a bare loop, steps 2..{args.steps}: harness_cost = harness time / "
        "mean time of the bare runs before and after it - 1"
    )
    print(LB.format_table(df))
    if df["busy"].any():
        print("\nthe machine was busy during a row marked busy: its numbers are not reference numbers")
    print(f"\nwrote {args.out}/loop_bench.csv")
    return 0


def _cores(others: float | None) -> str:
    return "an unknown number of cores" if others is None else f"{others:.2f} cores"


def run(args) -> int:
    if args.loop:
        return run_loop(args)
    if args.micro_batch_memory:
        return run_micro_batch(args)
    from harness.benchmarks import benchmark as B
    from harness.benchmarks import outputs

    settings = dict(preset="small", depths=None, seqs=[256], batch_size=8, repeats=5, warmup=2)
    if args.quick:
        settings.update(QUICK)
    given = dict(
        preset=args.preset,
        depths=_int_list("--depths", args.depths),
        seqs=_int_list("--seq", args.seq),
        batch_size=args.batch_size,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    settings.update({k: v for k, v in given.items() if v is not None})
    settings.update(
        variants=args.variants,
        widths=_int_list("--widths", args.widths),
        device=args.device,
        dtype=args.dtype or "float32",
        vocab=args.vocab,
        threads=args.threads,
        steps_per_repeat=args.steps_per_repeat,
        seed=args.seed,
        out_dir=args.out,
        references=not args.no_references,
        require_quiet=args.require_quiet,
    )
    if args.dry_run:
        settings["variants"] = B.resolve_variants(args.variants)
        return _print_settings(settings)

    if args.compile:
        return _run_compile(args, settings)
    df = B.bench(**settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    meta = df.attrs["meta"]
    print(
        f"device {meta['device']} {meta['gpu']}".rstrip() + f", dtype {meta['dtype']}, threads {meta['threads']}, "
        f"batch {meta['batch_size']}, vocab {meta['vocab_size']}, repeats {meta['repeats']} "
        f"(median; ratio against the mean of the two preln steps around each), warm-up {meta['warmup']}; "
        f"load average {meta['loadavg_before']} -> {meta['loadavg_after']} on {meta['cpu_count']} CPUs; "
        f"other processes kept {_cores(meta['others_before'])} busy before and {_cores(meta['others_during'])} "
        "during the run"
    )
    if meta["busy"]:
        print(
            "BUSY: other work competed for the cores during this run (above); its ratios are guidance, not "
            "reference numbers"
        )
    print(
        f"memory: {meta['memory_method']}; floor_time_ratio = 1 + extra FLOPs / model FLOPs per token; "
        f"state_B_per_tok = stream floats x 4 bytes; ratio_*_vs_ref = this implementation over the "
        f"straightforward one of the same math (ref_impl; preln: the plain pre-norm trunk)"
    )
    print(outputs.format_table(df))
    print()
    for line in outputs.scaling_lines(outputs.scaling(df)):
        print(line)
    plot = f"overhead_vs_{outputs.plot_axis(df)}.png"
    print(f"\nwrote {args.out}/bench.csv, bench_scaling.csv, bench_meta.json and {plot}")
    return 0
