"""What ``torch.compile`` gains: one training step (forward, loss, backward) of every variant, eager and compiled.

Each variant's model is built twice from the same draw; the compiled copy is warmed up until its graphs are
built (the first step's time is reported as the compile time), then eager and compiled steps alternate, so a
drift of the machine hits both alike. The speedup is the median eager step over the median compiled step.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from harness.benchmarks.benchmark import Shape, model_config, resolve_variants
from harness.benchmarks.timing import step_fn, time_steps
from harness.config import PRESETS
from harness.model.factory import build_model


def compile_gain(
    variants: Sequence[str] | None = None,
    *,
    preset: str = "small",
    seq_len: int = 256,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
):
    """One row per variant: eager and compiled step time, speedup, and the seconds the first compiled step took."""
    import pandas as pd

    base = PRESETS[preset]
    cfg = model_config(preset, Shape(2 * base["n_blocks"], base["d_model"], seq_len))
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch_size, seq_len + 1), generator=gen)
    idx, targets = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)  # (b, t) each
    rows = []
    for name in resolve_variants(variants):
        torch.manual_seed(seed)
        eager = build_model(cfg, name).to(dev).train()
        torch.manual_seed(seed)
        compiled = build_model(cfg, name).to(dev).train()
        compiled.compile(fullgraph=True)
        eager_step, compiled_step = step_fn(eager, idx, targets, dtype), step_fn(compiled, idx, targets, dtype)
        compile_s = time_steps(compiled_step, 1, dev)
        for _ in range(warmup):
            eager_step()
            compiled_step()
        eager_t, compiled_t = [], []
        for _ in range(repeats):
            eager_t.append(time_steps(eager_step, 1, dev))
            compiled_t.append(time_steps(compiled_step, 1, dev))
        e, c = statistics.median(eager_t), statistics.median(compiled_t)
        rows.append(
            {
                "variant": name,
                "eager_ms": e * 1e3,
                "compiled_ms": c * 1e3,
                "speedup": e / c,
                "compile_s": compile_s,
                "tokens_per_s_eager": batch_size * seq_len / e,
                "tokens_per_s_compiled": batch_size * seq_len / c,
            }
        )
        if log:
            log(
                f"  {name}: eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms ({e / c:.2f}x), "
                f"first compiled step {compile_s:.1f} s"
            )
        del eager, compiled
        torch._dynamo.reset()  # each variant's graphs are its own: keep the cache from growing across them
    frame = pd.DataFrame(rows)
    frame.attrs["meta"] = {
        "preset": preset,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "device": device,
        "dtype": dtype,
        "repeats": repeats,
        "warmup": warmup,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return frame
