"""What activation checkpointing costs a training step: each variant's step with ``train.activation_checkpointing``
off and on, interleaved, the order alternating between repeats so that load on the machine hits both alike.

    python -m harness.benchmarks.checkpointing [--preset small] [--vocab 4096] [--repeats 3]

A step is the trainer's (``memory_plan.training_step``, float32): forward, cross-entropy, backward, AdamW. Each
timing is one step after a warm-up step; the table gives each setting's median over the repeats and their ratio,
on over off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness.config import model_preset
from harness.model.factory import build_model
from harness.training.memory_plan import training_step


def step_times(variant: str, cfg, batch: int, seq: int, order: list[str]) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model(cfg, variant).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        training_step(model, optimizer, tokens, "32-true")
        optimizer.zero_grad(set_to_none=True)

    out = {}
    for setting in order:
        model.checkpoint_layers = setting == "on"
        step()
        start = time.perf_counter()
        step()
        out[setting] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> None:
    import variants

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(variants.names()))
    args = p.parse_args(argv)
    cfg = model_preset(args.preset, vocab_size=args.vocab)
    names = args.variants.split(",")
    times = {v: {"off": [], "on": []} for v in names}
    for r in range(args.repeats):
        for v in names:
            for setting, t in step_times(v, cfg, args.batch_size, args.seq, ["off", "on"][:: 1 - 2 * (r % 2)]).items():
                times[v][setting].append(t)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; seconds per step, median of {args.repeats}")
    print(f"{'variant':14s} {'off':>7s} {'on':>7s} {'on/off':>7s}")
    for v in names:
        off, on = (statistics.median(times[v][s]) for s in ("off", "on"))
        print(f"{v:14s} {off:7.3f} {on:7.3f} {on / off:7.2f}")


if __name__ == "__main__":
    main()
