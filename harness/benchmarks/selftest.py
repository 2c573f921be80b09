"""A self-check of a device: does every variant compute, train and run fast enough on it?

Three parts, one JSON (``selftest.json``) and one printed table:

1. **Numerics.** Every variant's forward and backward on the device in float32 (TF32 off) against the same
   weights on the CPU in float64: the largest logit error relative to the largest logit, and the gradient error
   relative to the gradient norm, for a fresh random batch and random targets.
2. **Training.** A short training run per variant through the real trainer, in bf16-mixed on a GPU (float32 on
   a CPU unless asked): every logged loss finite, and the last loss below the first.
3. **Speed.** Training steps of every variant at a preset (``gpt2-small`` by default) in bf16 autocast:
   tokens/s, the model FLOP/s the step reaches (3 x the cost model's forward FLOPs per token x tokens/s) and, on
   a card whose bf16 peak is known, the fraction of it; PreLN's fraction is the headline number.

Optionally (``compile=True``) a fourth part trains each variant eagerly and under ``torch.compile`` from the
same weights on the same batches and compares the losses step by step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from harness.benchmarks.timing import step_fn, sync
from harness.config import build_config, model_preset
from harness.errors import UsageError
from harness.io import atomic_write_json
from harness.model.factory import build_model
from harness.model.roofline import card_named

# bf16 dense peak, TFLOP/s (vendor data sheets), of cards outside the roofline's table (harness.model.roofline.CARDS,
# which has the A100, H100 and H200 with their bandwidth): enough to give a fraction of peak, not a floor.
OTHER_PEAK_BF16_TFLOPS = {
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "A6000": 155.0,
}


def card_peak_tflops(device: torch.device) -> float | None:
    """The bf16 dense peak of this CUDA card when its name is known, else None (and always None on a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    card = card_named(name)
    if card is not None:
        return card.peak_tflops
    # Longest names first: "L40S" before "L4".
    for key in sorted(OTHER_PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return OTHER_PEAK_BF16_TFLOPS[key]
    return None


def check_numerics(variant: str, cfg, device: torch.device, *, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """Float32 forward and backward on ``device`` against a float64 CPU reference of the same weights."""

    torch.manual_seed(seed)
    ref = build_model(cfg, variant).double()
    dev = build_model(cfg, variant)
    dev.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    dev = dev.to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(cfg.vocab_size, (batch, cfg.max_seq_len), generator=gen)
    targets = torch.randint(cfg.vocab_size, (batch, cfg.max_seq_len), generator=gen)
    out = {}
    for name, model, where in (("ref", ref, torch.device("cpu")), ("dev", dev, device)):
        logits = model(idx.to(where))  # (b, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.to(where).flatten())
        loss.backward()
        grads = {k: p.grad.detach().cpu().double() for k, p in model.named_parameters() if p.grad is not None}
        out[name] = (logits.detach().cpu().double(), grads)
    (ref_logits, ref_grads), (dev_logits, dev_grads) = out["ref"], out["dev"]
    logit_err = float((dev_logits - ref_logits).abs().max() / ref_logits.abs().max())
    num = math.sqrt(sum(float((dev_grads[k] - g).pow(2).sum()) for k, g in ref_grads.items()))
    den = math.sqrt(sum(float(g.pow(2).sum()) for g in ref_grads.values()))
    grad_err = num / den
    return {
        "variant": variant,
        "logits_rel_err": logit_err,
        "grad_rel_err": grad_err,
        "ok": logit_err < 1e-4 and grad_err < 1e-3 and set(dev_grads) == set(ref_grads),
    }


def check_training(
    variant: str, device: torch.device, out_dir: Path, *, preset: str, steps: int, precision: str, seed: int = 0
) -> dict[str, Any]:
    """A short run through the trainer: every loss finite and the last below the first."""
    import csv

    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.training.trainer import train

    cfg = build_config(
        {
            "model": {"preset": preset},
            "variant": variant,
            "train": {
                "max_steps": steps,
                "batch_size": 8,
                "seq_len": min(128, build_config({"model": {"preset": preset}}).model.max_seq_len),
                "warmup_steps": max(1, steps // 10),
                "lr": 3e-3,
                "log_every_steps": 1,
                "val_every_steps": steps,
                "val_batches": 1,
                "ckpt_every_steps": steps,
                "precision": precision,
                "seed": seed,
                "accelerator": "gpu" if device.type == "cuda" else "cpu",
            },
        }
    )
    run_dir = train(cfg, out_dir / variant, resume=False)
    with open(run_dir / "metrics.csv", newline="") as f:
        losses = [float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]]
    finite = all(math.isfinite(v) for v in losses)
    return {
        "variant": variant,
        "steps": steps,
        "precision": precision,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "ok": finite and len(losses) == steps and losses[-1] < losses[0],
    }


def measure_speed(
    variant: str,
    device: torch.device,
    *,
    preset: str,
    seq_len: int,
    batch: int,
    dtype: str,
    steps: int,
    warmup: int,
    peak_tflops: float | None,
    compiled: bool = False,
) -> dict[str, Any]:
    """Tokens/s of training steps (forward, loss, backward; no optimizer) and the FLOP/s they reach; with
    ``compiled``, of the model under ``torch.compile(fullgraph=True)``, its first steps (the compile) untimed."""
    from harness.model.costs import mixer_flops_per_token, preln_flops_per_token

    cfg = model_preset(preset, max_seq_len=max(seq_len, model_preset(preset).max_seq_len))
    torch.manual_seed(0)
    model = build_model(cfg, variant).to(device).train()
    tokens = torch.randint(cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    idx, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    step = step_fn(torch.compile(model, fullgraph=True) if compiled else model, idx, targets, dtype)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    sec = statistics.median(times)
    tokens_per_s = batch * seq_len / sec
    flops = 3 * (preln_flops_per_token(cfg, seq_len) + mixer_flops_per_token(model.mixer)) * tokens_per_s
    mem = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    del model, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {
        "variant": variant,
        "preset": preset,
        "seq_len": seq_len,
        "batch": batch,
        "dtype": dtype,
        "step_ms": sec * 1e3,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "peak_fraction": None if peak_tflops is None else flops / 1e12 / peak_tflops,
        "peak_mem_bytes": mem,
    }


def check_compile(variant: str, cfg, *, steps: int, seed: int = 0) -> dict[str, Any]:
    """Eager and compiled training (AdamW, the same batches) from the same weights: largest loss difference."""

    losses = {}
    for compiled in (False, True):
        torch.manual_seed(seed)
        model = build_model(cfg, variant).train()
        if compiled:
            model.compile(fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
        gen = torch.Generator().manual_seed(seed + 1)
        run = []
        for _ in range(steps):
            tokens = torch.randint(cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=gen)
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run.append(float(loss))
        losses[compiled] = run
        torch._dynamo.reset()
    diff = max(abs(a - b) for a, b in zip(losses[False], losses[True]))
    return {"variant": variant, "steps": steps, "max_loss_diff": diff, "ok": diff <= 1e-4}


def _checked_names(device: str, variants, check_preset: str, counts: dict[str, int]) -> list[str]:
    """The variants to test, once the device is there, every count is positive and every variant builds."""
    import variants as registry

    if device not in ("cpu", "cuda"):
        raise UsageError(f"Unknown device {device!r}: allowed values are cpu, cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; use --device cpu.")
    for name, value in counts.items():
        if value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}.")
    names = list(variants) if variants else registry.names()
    for name in names:
        registry.validate(
            name, d_model=model_preset(check_preset).d_model, n_layers=model_preset(check_preset).n_layers
        )
    return names


def _measure_speeds(report: dict, names, dev, modes, speed: dict, say) -> None:
    """Tokens/s and TFLOP/s of every variant, eager and (where ``modes`` asks) compiled, into ``report``."""
    for compiled in modes:
        for name in names:
            row = measure_speed(name, dev, compiled=compiled, **speed)
            report["speed_compiled" if compiled else "speed"].append(row)
            how = ", compiled" if compiled else ""
            say(f"speed {name}{how}: {row['tokens_per_s']:,.0f} tokens/s, {row['tflops']:.2f} TFLOP/s")
            if compiled:
                torch._dynamo.reset()


def selftest(
    device: str = "cuda",
    *,
    variants: Sequence[str] | None = None,
    check_preset: str = "tiny",
    train_preset: str = "tiny",
    train_steps: int = 50,
    precision: str | None = None,
    bench_preset: str = "gpt2-small",
    bench_seq: int = 1024,
    bench_batch: int = 8,
    bench_dtype: str = "bf16",
    bench_steps: int = 10,
    bench_warmup: int = 3,
    compile: bool = False,
    compile_steps: int = 20,
    out_dir: str | Path = "results/selftest",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every part on ``device``; returns (and writes to ``out_dir/selftest.json``) what each part found."""
    counts = {"--train-steps": train_steps, "--bench-steps": bench_steps, "--bench-seq": bench_seq}
    names = _checked_names(
        device, variants, check_preset, {**counts, "--bench-batch": bench_batch, "--compile-steps": compile_steps}
    )
    dev = torch.device(device)
    out_dir = Path(out_dir)
    say = log or (lambda _msg: None)
    # Float32 on the device means float32: TF32 matmuls would be a 1e-3 error by design, not a fault.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    precision = precision or ("bf16-mixed" if device == "cuda" else "32-true")
    peak = card_peak_tflops(dev)
    report: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name(dev) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "peak_bf16_tflops": peak,
        "numerics": [],
        "training": [],
        "speed": [],
        "speed_compiled": [],
        "compile": [],
    }
    check_cfg = model_preset(check_preset)
    for name in names:
        report["numerics"].append(row := check_numerics(name, check_cfg, dev))
        say(f"numerics {name}: logits {row['logits_rel_err']:.1e}, gradients {row['grad_rel_err']:.1e}")
    for name in names:
        report["training"].append(
            row := check_training(
                name, dev, out_dir / "runs", preset=train_preset, steps=train_steps, precision=precision
            )
        )
        say(f"training {name}: loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}")
    speed = dict(
        preset=bench_preset,
        seq_len=bench_seq,
        batch=bench_batch,
        dtype=bench_dtype,
        steps=bench_steps,
        warmup=bench_warmup,
        peak_tflops=peak,
    )
    # Studies train compiled on a GPU (train.compile=auto): there its speed is measured beside eager's.
    _measure_speeds(report, names, dev, (False, True) if compile or device == "cuda" else (False,), speed, say)
    if compile:
        for name in names:
            report["compile"].append(row := check_compile(name, check_cfg, steps=compile_steps))
            say(f"compile {name}: largest loss difference {row['max_loss_diff']:.1e}")
    preln = next((r for r in report["speed"] if r["variant"] == "preln"), None)
    report["preln_peak_fraction"] = preln["peak_fraction"] if preln else None
    report["ok"] = all(r["ok"] for part in ("numerics", "training", "compile") for r in report[part])
    atomic_write_json(out_dir / "selftest.json", report)
    return report


def format_report(report: dict[str, Any]) -> str:
    """One row per variant: numerics, training, speed (and compile), then the verdict."""
    import pandas as pd

    parts = ("numerics", "training", "speed", "speed_compiled", "compile")
    by = {part: {r["variant"]: r for r in report.get(part, [])} for part in parts}
    rows = []
    for name in by["numerics"]:
        n, t, s, c = by["numerics"][name], by["training"].get(name), by["speed"].get(name), by["compile"].get(name)
        row = {
            "variant": name,
            "logits_err": f"{n['logits_rel_err']:.1e}",
            "grad_err": f"{n['grad_rel_err']:.1e}",
            "loss_first": f"{t['first_loss']:.3f}" if t else "",
            "loss_last": f"{t['last_loss']:.3f}" if t else "",
            "tokens_per_s": f"{s['tokens_per_s']:,.0f}" if s else "",
            "TFLOP/s": f"{s['tflops']:.3g}" if s else "",
            "of_peak": f"{s['peak_fraction']:.1%}" if s and s["peak_fraction"] is not None else "",
            "ok": "yes" if n["ok"] and (t is None or t["ok"]) and (c is None or c["ok"]) else "NO",
        }
        sc = by["speed_compiled"].get(name)
        if sc:
            row["compiled_tokens_per_s"] = f"{sc['tokens_per_s']:,.0f}"
            row["compiled_of_peak"] = f"{sc['peak_fraction']:.1%}" if sc["peak_fraction"] is not None else ""
        if c:
            row["compile_diff"] = f"{c['max_loss_diff']:.1e}"
        rows.append(row)
    head = (
        f"{report['device_name']} ({report['device']}), torch {report['torch']}, bf16 peak "
        f"{report['peak_bf16_tflops'] or 'unknown'} TFLOP/s"
    )
    frac = report.get("preln_peak_fraction")
    tail = "all checks passed" if report["ok"] else "SOME CHECKS FAILED"
    if frac is not None:
        tail += f"; PreLN reaches {frac:.1%} of the card's bf16 peak"
    return "\n".join([head, pd.DataFrame(rows).to_string(index=False), tail])
