"""``depthmem selftest``: every variant's numerics, a short training run and the speed on a device, in one JSON."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "selftest",
        help="check a device: numerics against float64, short training runs, speed (one JSON)",
        description="For every variant: forward and backward in float32 on the device against a float64 CPU "
        "reference, a short bf16-mixed training run (finite, loss falling), and training-step speed "
        "at a preset in bf16 with the fraction of the card's peak FLOP/s. Writes selftest.json and "
        "prints a table; exits 1 when a check fails.",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--variants", default=None, help="comma-separated variants (default: all registered)")
    p.add_argument("--check-preset", default="tiny", help="model preset of the numerics check (default: tiny)")
    p.add_argument("--train-preset", default="tiny", help="model preset of the training runs (default: tiny)")
    p.add_argument("--train-steps", type=int, default=50, help="steps of each training run (default: 50)")
    p.add_argument(
        "--precision",
        default=None,
        help="Lightning precision of the training runs (default: bf16-mixed on cuda, 32-true on cpu)",
    )
    p.add_argument("--bench-preset", default="gpt2-small", help="model preset of the speed part (default: gpt2-small)")
    p.add_argument("--bench-seq", type=int, default=1024, help="sequence length of the speed part (default: 1024)")
    p.add_argument("--bench-batch", type=int, default=8, help="sequences per step of the speed part (default: 8)")
    p.add_argument("--bench-dtype", default="bf16", help="bf16 (default) or float32")
    p.add_argument("--bench-steps", type=int, default=10, help="timed steps per variant (default: 10)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also train each variant eagerly and under torch.compile and compare the losses",
    )
    p.add_argument("--compile-steps", type=int, default=20, help="steps of the compile comparison (default: 20)")
    p.add_argument("--out", default="results/selftest", help="folder for selftest.json (default: results/selftest)")
    return p


def run(args) -> int:
    import sys

    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.benchmarks.selftest import format_report, selftest

    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    report = selftest(
        args.device,
        variants=variants,
        check_preset=args.check_preset,
        train_preset=args.train_preset,
        train_steps=args.train_steps,
        precision=args.precision,
        bench_preset=args.bench_preset,
        bench_seq=args.bench_seq,
        bench_batch=args.bench_batch,
        bench_dtype=args.bench_dtype,
        bench_steps=args.bench_steps,
        compile=args.compile,
        compile_steps=args.compile_steps,
        out_dir=args.out,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(format_report(report))
    print(f"wrote {args.out}/selftest.json")
    return 0 if report["ok"] else 1
