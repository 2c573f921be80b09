"""One step of ``make gpu-bench``, run in a process of its own (``harness.benchmarks.gpu`` starts it with a timeout):
the training steps of every variant at one depth in one mode, or ``preln`` compiled at growing micro batches.

Each row is appended to the ``--rows`` file as one JSON line the moment it is measured, so a step killed at its
timeout still hands back the rows it finished. The exit status is 1 when a row failed.

    python -m harness.benchmarks.gpu_steps steps --depth 24 --mode compiled --rows rows.jsonl ...
    python -m harness.benchmarks.gpu_steps micro --batches 8,16,32,64 --rows rows.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from harness.benchmarks.benchmark import Shape, model_config
from harness.benchmarks.timing import step_fn, sync, time_steps
from harness.config import PRESETS
from harness.model.costs import preln_flops_per_token
from harness.model.factory import build_model
from variants import kernels

SYNCS = ("aten::item", "aten::_local_scalar_dense")
# A mode's torch.compile and the fused kernels' setting.
MODES = {"eager": (False, "auto"), "compiled": (True, "auto"), "compiled, kernels off": (True, "off")}


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


def _inputs(cfg, batch: int, seq_len: int, device: torch.device):
    tokens = torch.randint(cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _measure(step, device: torch.device, repeats: int, warmup: int) -> dict:
    started = time.perf_counter()
    step()  # compiles, where it does
    first_s = time.perf_counter() - started
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [time_steps(step, 1, device) for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    n_kernels, syncs = _profile_counts(step, device)
    return {"ms": statistics.median(times) * 1e3, "first_step_s": first_s, "peak_bytes": peak} | {
        "kernels_per_step": n_kernels,
        "syncs_per_step": syncs,
        "error": "",
    }


def step_rows(args, emit) -> bool:
    """Every variant's step at ``args.depth`` in ``args.mode``; True when all of them ran."""
    device = torch.device(args.device)
    cfg = model_config(args.preset, Shape(args.depth, PRESETS[args.preset]["d_model"], args.seq))
    idx, targets = _inputs(cfg, args.batch, args.seq, device)
    compiled, kernel_mode = MODES[args.mode]
    kernels.set_mode(kernel_mode)
    ok = True
    for name in args.variants.split(";"):
        torch.manual_seed(0)
        model = build_model(cfg, name).to(device).train()
        forward = torch.compile(model, fullgraph=True, backend=args.backend) if compiled else model
        try:
            row = _measure(step_fn(forward, idx, targets, args.dtype), device, args.repeats, args.warmup)
        except Exception as e:  # a variant that fails to compile is a finding, not the end of the step
            row, ok = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, False
        emit({"depth": args.depth, "mode": args.mode, "variant": name, **row})
        del model, forward
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return ok


def micro_rows(args, emit) -> bool:
    """``preln`` compiled once, its batch dimension dynamic, timed at each micro batch up to the largest that fits."""
    device = torch.device(args.device)
    base = PRESETS[args.preset]
    cfg = model_config(args.preset, Shape(2 * base["n_blocks"], base["d_model"], args.seq))
    torch.manual_seed(0)
    model = build_model(cfg, "preln").to(device).train()
    forward = torch.compile(model, fullgraph=True, backend=args.backend)
    for batch in (int(b) for b in args.batches.split(",")):
        idx, targets = _inputs(cfg, batch, args.seq, device)
        # One graph for every micro batch: without this each new batch size would compile again.
        torch._dynamo.mark_dynamic(idx, 0)
        torch._dynamo.mark_dynamic(targets, 0)
        step = step_fn(forward, idx, targets, args.dtype)
        try:
            for _ in range(1 + args.warmup):
                step()
            sec = statistics.median(time_steps(step, 1, device) for _ in range(args.repeats))
        except torch.OutOfMemoryError:
            emit({"batch": batch, "error": "out of memory"})
            break
        tokens_per_s = batch * args.seq / sec
        tflops = 3 * preln_flops_per_token(cfg, args.seq) * tokens_per_s / 1e12
        emit({"batch": batch, "ms": sec * 1e3, "tokens_per_s": tokens_per_s, "tflops": tflops, "error": ""})
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.benchmarks.gpu_steps")
    parser.add_argument("what", choices=("steps", "micro"))
    parser.add_argument("--rows", required=True, help="the JSON-lines file each row is appended to")
    parser.add_argument("--preset", required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (default: 1)")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--variants", default="preln", help="variants separated by ';'")
    parser.add_argument("--depth", type=int)
    parser.add_argument("--mode", choices=tuple(MODES))
    parser.add_argument("--batch", type=int)
    parser.add_argument("--batches", default="")
    args = parser.parse_args(argv)
    path = Path(args.rows)

    def emit(row: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    ok = (step_rows if args.what == "steps" else micro_rows)(args, emit)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
