"""The prepared GPU check (``make gpu-bench``): everything the speed targets are judged on, in one run on one card,
into one folder, in this order:

1. Every variant's training step (forward, loss, backward) at ``gpt2-small``, T = 1024, bf16, with the fused kernels
   on: compiled (``fullgraph=True``) at 24 sublayers, eager at 24, compiled and eager at 48, and compiled with the
   kernels off at 24. Each row: milliseconds, ratio to ``preln`` in the same mode, the roofline's floor of the step
   on the card (``harness.model.roofline``) and the time as a multiple of it, peak memory and its ratio, and from
   the profiler the GPU kernels launched and the host synchronisations per step.
2. ``preln`` compiled once at growing micro batches: tokens/s and the fraction of the card's bf16 peak.
3. ``depthmem bench --loop`` on the card: the harness's training loop against a bare loop.
4. ``depthmem selftest`` on the card (every variant's numerics against the float64 CPU reference, training falls).

Each step runs in a process of its own with a timeout, and the whole run keeps to ``--minutes`` (8): a step is
given what is left of it and killed when that runs out, keeping the rows it finished; the steps after it are
skipped. The tables are rewritten after every step. The exit status is 1 when a step failed, timed out or was
skipped, 2 on bad settings. ``--quick`` runs the same code at the ``tiny`` preset on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UsageError
from harness.io import atomic_write_text
from harness.model.roofline import CARDS, Card, card_named, card_or_refuse

SETTINGS = {  # preset, T, batch, the two depths, timed repeats, micro batches, untimed steps after the first
    "full": ("gpt2-small", 1024, 8, (24, 48), 5, (8, 16, 32, 64), 1),
    "quick": ("tiny", 64, 4, (2, 4), 1, (2, 4), 0),
}


@dataclass
class Step:
    name: str
    argv: list[str]
    rows: Path | None = None
    planned: list[dict] = field(default_factory=list)
    """The rows the step is to measure: (depth, mode, variant) keys, so a missing one can be reported."""
    status: str = "skipped: time budget"
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of the step's process and the children it waited for: on a busy machine, what it would take alone."""


def _plan(args, out: Path, variants: list[str]) -> list[Step]:
    preset, seq, batch, depths, repeats, batches, warmup = SETTINGS["quick" if args.quick else "full"]
    dtype = "bf16" if args.device.startswith("cuda") else "float32"
    worker = [sys.executable, "-m", "harness.benchmarks.gpu_steps"]
    common = ["--preset", preset, "--seq", str(seq), "--device", args.device, "--dtype", dtype]
    common += ["--repeats", str(repeats), "--warmup", str(warmup), "--backend", args.backend]
    order = [(depths[0], "compiled"), (depths[0], "eager")]
    order += [(depths[1], "compiled"), (depths[1], "eager"), (depths[0], "compiled, kernels off")]
    steps = []
    for depth, mode in order:
        rows = out / "rows" / f"steps-{depth}-{mode.replace(', ', '-').replace(' ', '-')}.jsonl"
        argv = [*worker, "steps", "--rows", str(rows), *common, "--depth", str(depth), "--mode", mode]
        argv += ["--batch", str(batch), "--variants", ";".join(variants)]
        planned = [{"depth": depth, "mode": mode, "variant": v} for v in variants]
        steps.append(Step(f"steps L={depth} {mode}", argv, rows, planned))
    rows = out / "rows" / "micro.jsonl"
    micro = [*worker, "micro", "--rows", str(rows), *common, "--batches", ",".join(map(str, batches))]
    steps.append(Step("micro batches", micro, rows))
    cli = [sys.executable, "-m", "harness.cli"]
    loop = ["--preset", "small", "--steps", "31"]
    if args.quick:  # one variant, short sequences and few steps; every event of the loop still fires
        loop = ["--preset", "tiny", "--seq", "32", "--batch-size", "4", "--variants", "preln", "--steps", "5"]
        loop += ["--log-every", "2", "--val-every", "4", "--ckpt-every", "4", "--val-batches", "1"]
    steps.append(
        Step("bench --loop", [*cli, "bench", "--loop", "--device", args.device, *loop, "--out", str(out / "loop")])
    )
    check = ["--check-preset", "tiny", "--train-preset", "tiny"]
    if args.quick:
        check += [
            "--train-steps",
            "6",
            "--bench-preset",
            "tiny",
            "--bench-seq",
            "32",
            "--bench-batch",
            "2",
            "--bench-steps",
            "2",
        ]
    # --quick checks PreLN and the mixer with the most machinery; tests/test_selftest.py covers the self-check itself.
    chosen = ["--variants", ",".join(variants)] if args.variants else (["--variants", "preln,ldm-rls"] * args.quick)
    selftest = [*cli, "selftest", "--device", args.device, *chosen, *check]
    steps.append(Step("selftest", [*selftest, "--out", str(out / "selftest")]))
    return steps


def _run(step: Step, timeout: float, log_dir: Path) -> None:
    """Runs ``step`` in its own process group; kills the group at ``timeout`` seconds (its children too)."""
    if step.rows is not None:
        step.rows.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (re.sub(r"[^A-Za-z0-9]+", "-", step.name).strip("-") + ".log")
    started, cpu = time.monotonic(), _children_cpu()
    with log_path.open("w") as log:
        proc = subprocess.Popen(step.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            step.status = "ok" if code == 0 else f"failed: exit {code} (see {log_path.name})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            step.status = f"timed out after {timeout:.0f} s"
    step.seconds, step.cpu_seconds = time.monotonic() - started, _children_cpu() - cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _read_rows(step: Step) -> list[dict]:
    if step.rows is None or not step.rows.exists():
        found = []
    else:
        found = [json.loads(line) for line in step.rows.read_text().splitlines() if line.strip()]
    keys = {(r["depth"], r["mode"], r["variant"]) for r in found if "variant" in r}
    missing = "skipped: time budget" if step.status.startswith("skipped") else f"not measured: step {step.status}"
    return found + [{**p, "error": missing} for p in step.planned if tuple(p.values()) not in keys]


def _roofline_columns(frame, card: Card | None, shape: tuple[str, int, int]):
    """Per row: tokens/s and the model TFLOP/s reached (3 x the cost model's forward FLOPs per token, trunk and
    mixer), and on a card of the roofline's table the step's floor, the time as a multiple of it, and the floor as a
    multiple of ``preln``'s."""
    from harness.benchmarks.benchmark import Shape, model_config
    from harness.config import PRESETS
    from harness.model.roofline import variant_costs

    preset, seq, batch = shape
    if "ms" not in frame:
        return frame
    costs = {}
    for depth, name in set(zip(frame.depth, frame.variant)):
        model = model_config(preset, Shape(int(depth), PRESETS[preset]["d_model"], seq))
        costs[depth, name] = (variant_costs(name, model, seq), variant_costs("preln", model, seq))
    frame["d_model"], frame["seq_len"] = PRESETS[preset]["d_model"], seq  # the shape the rates hold for
    frame["tokens_per_s"] = batch * seq / (frame.ms / 1e3)
    frame["model_tflops"] = [
        costs[k][0].flops(True) * t / 1e12 for k, t in zip(zip(frame.depth, frame.variant), frame.tokens_per_s)
    ]
    if card is None:
        return frame
    frame["floor_ms"] = [costs[k][0].floor_s(card) * batch * seq * 1e3 for k in zip(frame.depth, frame.variant)]
    frame["floor_x_preln"] = [
        c.floor_s(card) / b.floor_s(card) for c, b in (costs[k] for k in zip(frame.depth, frame.variant))
    ]
    frame["time_x_floor"] = frame.ms / frame.floor_ms
    return frame


def _with_ratios(rows: list[dict]):
    import pandas as pd

    frame = pd.DataFrame(rows)
    if "ms" not in frame:
        return frame
    base = frame[frame.variant == "preln"].set_index(["depth", "mode"])
    key = list(zip(frame.depth, frame["mode"]))
    frame["time_ratio"] = [ms / base.ms.get(k, float("nan")) for ms, k in zip(frame.ms, key)]
    if "peak_bytes" in frame and frame.peak_bytes.notna().any():
        frame["memory_ratio"] = [b / base.peak_bytes.get(k, float("nan")) for b, k in zip(frame.peak_bytes, key)]
    return frame


def _report(out: Path, head: list[str], steps: list[Step], card: Card | None, device_name: str, shape):
    """``steps.csv``, ``micro_batch.csv`` and ``gpu-bench.md`` from what the steps have brought back so far; returns
    the step table."""
    import pandas as pd

    # The timed rows come from the steps that planned variants; the micro batches from their own step.
    table = _roofline_columns(_with_ratios([r for s in steps if s.planned for r in _read_rows(s)]), card, shape)
    table.insert(0, "card", device_name)
    micro = pd.DataFrame([r for s in steps if s.name == "micro batches" for r in _read_rows(s)])
    if card is not None and "tflops" in micro:
        micro["peak_fraction"] = micro.tflops / card.peak_tflops
    table.to_csv(out / "steps.csv", index=False)
    micro.to_csv(out / "micro_batch.csv", index=False)
    status = pd.DataFrame(
        [{"step": s.name, "status": s.status, "seconds": s.seconds, "cpu_seconds": s.cpu_seconds} for s in steps]
    )
    status.to_csv(out / "status.csv", index=False)
    floor = (
        f"floors from the roofline of the {card.name} ({card.peak_tflops:g} TFLOP/s bf16, {card.bandwidth_tbs:g} TB/s)"
        if card
        else "no floors: the card is not in the roofline's table (--card names one of " + ", ".join(CARDS) + ")"
    )
    text = [
        *head,
        "",
        f"Ratios to `preln` in the same mode and depth; `time_x_floor` is the step's time over its own floor; {floor}.",
        "",
        status.to_markdown(index=False, floatfmt=".1f"),
        "",
        table.to_markdown(index=False, floatfmt=".3g") if len(table) else "(no rows)",
        "",
        "## `preln` compiled, by micro batch",
        "",
        micro.to_markdown(index=False, floatfmt=".3g") if len(micro) else "(none)",
        "",
    ]
    atomic_write_text(out / "gpu-bench.md", "\n".join(text))
    return table


def _print_rows(table, step: Step) -> None:
    """Each measured row of ``step``: its time, as a multiple of ``preln``'s and of its own floor."""
    for p in step.planned:
        row = table[(table.depth == p["depth"]) & (table["mode"] == p["mode"]) & (table.variant == p["variant"])]
        if len(row) and "ms" in row and row.ms.notna().iloc[0]:
            r = row.iloc[0]
            floor = f", {r.time_x_floor:.3g}x its floor" if "time_x_floor" in row else ""
            print(f"  {r.variant:<16} {r.ms:9.2f} ms, {r.time_ratio:.3f}x preln{floor}", flush=True)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m harness.benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu-bench", help="the folder everything goes to")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (the default with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny preset, short sequences, on CPU")
    parser.add_argument("--variants", default="", help="comma-separated variants (default: all registered)")
    parser.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend (default: inductor; with --quick on CPU eager, which traces each model as one "
        "graph and runs it without building kernels)",
    )
    parser.add_argument("--card", default=None, help="the roofline's card (default: the CUDA device's name)")
    parser.add_argument("--minutes", type=float, default=8.0, help="the whole run's time limit (default: 8)")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick else "cuda")
    args.backend = args.backend or ("eager" if args.quick and args.device == "cpu" else "inductor")
    if not args.minutes > 0:
        raise UsageError(f"--minutes must be a positive number, got {args.minutes}.")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    from harness.benchmarks.benchmark import resolve_variants

    try:
        args = _parse(argv)
        variants = resolve_variants([v for v in re.split(r",(?![^()]*\))", args.variants) if v.strip()] or None)
        card = card_or_refuse(args.card) if args.card else None
    except UsageError as e:
        print(f"depthmem: {e}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("depthmem: --device cuda asked for, but this machine has no CUDA GPU; use --device cpu.", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(args.device))
        card = card or card_named(name)
    else:
        name = platform.processor() or "CPU"
    deadline = time.monotonic() + args.minutes * 60
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    preset, seq, batch = SETTINGS["quick" if args.quick else "full"][:3]
    head = [f"# GPU bench: {name}, torch {torch.__version__}", "", f"`{preset}`, T = {seq}, batch {batch}."]
    steps = _plan(args, out, variants)
    for step in steps:  # rows of an earlier run in the same folder are not this run's
        if step.rows is not None:
            step.rows.unlink(missing_ok=True)
    for step in steps:
        left = deadline - time.monotonic()
        if left > 1:
            print(f"{step.name}: running (at most {left:.0f} s)", flush=True)
            _run(step, left, out / "logs")
        print(f"{step.name}: {step.status} ({step.seconds:.1f} s, {step.cpu_seconds:.1f} s of CPU)", flush=True)
        _print_rows(_report(out, head, steps, card, name, (preset, seq, batch)), step)
    print((out / "gpu-bench.md").read_text())
    print(f"depthmem: wrote {out / 'gpu-bench.md'}")
    return 0 if all(s.status == "ok" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
