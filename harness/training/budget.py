"""Training budgets: how many optimizer steps and tokens a run trains on, the same for every run of a comparison.

A budget is given one of three ways, in this order of precedence: ``train.max_steps`` (steps), ``train.tokens``
(tokens, rounded up to whole steps) or ``train.tokens_per_param`` (tokens per parameter). A budget per
parameter is counted against one model, the *baseline* of the comparison, never against each run's own model:
a variant that adds parameters would otherwise train on more tokens, with a longer schedule, than the baseline
it is compared with, and every difference between them would mix the method with the budget. A single run
counts against the PreLN decoder of its size; a grid resolves the budget once from its ``report.baseline``
(``resolve``) and writes it into every run's config as ``train.tokens``, so all runs of one model size share
one token count and one learning-rate schedule.
"""

from __future__ import annotations

import dataclasses
import math

from harness.config import ModelConfig, RunConfig

DEFAULT_BASELINE = "preln"


def seq_len_of(cfg: RunConfig) -> int:
    return cfg.train.seq_len or cfg.model.max_seq_len


def tokens_per_step(cfg: RunConfig) -> int:
    """Tokens of one optimizer step: the global batch of sequences times their length."""
    return cfg.train.batch_size * seq_len_of(cfg)


def baseline_params(model: ModelConfig, baseline: str = DEFAULT_BASELINE) -> int:
    """Parameters of the decoder of this size with the depth mixer ``baseline`` (a variant name)."""
    import torch

    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    import variants
    from harness.model.costs import preln_params
    from harness.model.factory import build_model

    if variants.canonical(baseline) == DEFAULT_BASELINE:
        return preln_params(model)
    with torch.device("meta"):  # shapes only: counting a GPT-2-sized model allocates nothing
        return build_model(model, baseline).num_params()


def train_steps(cfg: RunConfig) -> int:
    """Optimizer steps of the run: ``max_steps``, else its token budget in whole steps (at least one)."""
    t = cfg.train
    if t.max_steps:
        return t.max_steps
    tokens = t.tokens or t.tokens_per_param * baseline_params(cfg.model)
    return max(1, math.ceil(tokens / tokens_per_step(cfg)))


def train_tokens(cfg: RunConfig) -> int:
    """Tokens the run trains on: its steps times the tokens of one step."""
    return train_steps(cfg) * tokens_per_step(cfg)


def resolve(cfg: RunConfig, baseline: str = DEFAULT_BASELINE, *, cache: dict | None = None) -> RunConfig:
    """``cfg`` with a per-parameter budget turned into ``train.tokens`` counted against ``baseline`` at its size.

    A run that already fixes its steps or tokens is returned unchanged. ``cache`` (model config -> parameter
    count) spares rebuilding the baseline for every run of a grid.
    """
    t = cfg.train
    if t.max_steps or t.tokens:
        return cfg
    key = (baseline, tuple(sorted(dataclasses.asdict(cfg.model).items())))
    if cache is None or key not in cache:
        n = baseline_params(cfg.model, baseline)
        if cache is not None:
            cache[key] = n
    else:
        n = cache[key]
    tokens = max(1, math.ceil(t.tokens_per_param * n))
    return dataclasses.replace(cfg, train=dataclasses.replace(t, tokens=tokens))
