"""The dry run's cost estimate, checked against counted FLOPs and a built model."""

from __future__ import annotations

import pytest
import torch
from cli_checks import dry_run_text
from torch.utils.flop_counter import FlopCounterMode

from harness.config import build_config
from harness.model.costs import preln_flops_per_token
from harness.model.factory import build_model
from harness.sweeps.estimate import run_cost
from harness.sweeps.profiles import Profile


def test_preln_run_cost_matches_counted_flops_and_parameters():
    cfg = build_config({"model": {"preset": "tiny"}, "train": {"max_steps": 10, "batch_size": 8, "seq_len": 32}})
    torch.manual_seed(0)
    model = build_model(cfg.model, "preln")
    idx = torch.randint(0, cfg.model.vocab_size, (1, 32))
    with FlopCounterMode(display=False) as counter:
        model(idx)
    # The counter sees every matrix multiply but not the CPU attention kernel: its scores and weighted sum,
    # 4 T d per token and attention layer in closed form, are added by hand.
    counted = counter.get_total_flops() + cfg.model.n_blocks * 4 * 32 * 32 * cfg.model.d_model
    assert preln_flops_per_token(cfg.model, 32) * 32 == counted
    cost = run_cost(cfg, peak_tflops=100.0, utilisation=0.5)
    tokens = 10 * 8 * 32
    assert (cost["params"], cost["steps"], cost["tokens"]) == (model.num_params(), 10, tokens)
    assert cost["train_flops"] == 3 * counted / 32 * tokens
    assert cost["gpu_hours"] == pytest.approx(cost["train_flops"] / (0.5 * 100e12) / 3600, rel=1e-12)


def test_a_matched_preln_counts_its_widened_mlps():
    base = {"model": {"preset": "tiny"}, "train": {"max_steps": 10, "batch_size": 8}}
    cfg = build_config({**base, "variant": "preln(match=ldm-rls)"})
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.variant)
    assert model.cfg.ffn_hidden > cfg.model.ffn_hidden
    seq = cfg.model.max_seq_len
    idx = torch.randint(0, cfg.model.vocab_size, (1, seq))
    with FlopCounterMode(display=False) as counter:
        model(idx)
    counted = counter.get_total_flops() + cfg.model.n_blocks * 4 * seq * seq * cfg.model.d_model
    cost = run_cost(cfg, peak_tflops=100.0, utilisation=0.5)
    assert cost["params"] == model.num_params()
    assert cost["train_flops"] == 3 * counted / seq * cost["tokens"]
    plain = run_cost(build_config(base), peak_tflops=100.0, utilisation=0.5)
    assert cost["train_flops"] > plain["train_flops"]


def test_a_mixer_adds_its_flops_and_parameters():
    base = {"model": {"preset": "tiny"}, "train": {"max_steps": 10, "batch_size": 8}}
    preln = run_cost(build_config(base), peak_tflops=312, utilisation=0.4)
    hc = run_cost(build_config({**base, "variant": "hc"}), peak_tflops=312, utilisation=0.4)
    mixer = build_model(build_config(base).model, "hc").mixer
    assert hc["params"] - preln["params"] == mixer.extra_params()
    assert hc["train_flops"] - preln["train_flops"] == 3 * mixer.extra_flops_per_token() * hc["tokens"]


def test_dry_run_prints_costs_per_run_and_total(tmp_path, capsys):
    profile = "nodes: 2\ntasks_per_node: 4\ngpus_per_node: 4\ngpu_peak_tflops: 989\nutilisation: 0.5\n"
    out = dry_run_text(capsys, tmp_path, profile, ["preln", "hc"], tmp_path / "r")
    assert "GPU time at 50% of a 989 TFLOP/s bf16 peak" in out
    costs = [
        run_cost(
            build_config(
                {
                    "model": {"preset": "tiny"},
                    "variant": v,
                    "train": {"max_steps": 100, "batch_size": 16, "devices": 4, "num_nodes": 2},
                }
            ),
            peak_tflops=989,
            utilisation=0.5,
        )
        for v in ("preln", "hc")
    ]
    total = sum(c["train_flops"] for c in costs)
    assert f"total: 2 run(s), {2 * 100 * 16 * 64 / 1e6:.3g}M tokens, {total:.3e} training FLOPs" in out
    # A grid this small still reads in its own units: no zero tokens, no zero GPU time.
    minutes = sum(c["gpu_hours"] for c in costs) * 60
    assert f"{minutes:.2g} GPU-min" in out and minutes > 0
    assert "0.000B" not in out and " 0.0 " not in out and "0M " not in out


@pytest.mark.parametrize(
    "tokens, hours, shown_tokens, shown_time",
    [
        (102_400, 1.2e-5, "0.102M", "0.00072 GPU-min"),
        (2_500_000, 0.5, "2.5M", "30 GPU-min"),
        (3_000_000_000, 1500.0, "3,000M", "1,500 GPU-h"),
    ],
)
def test_costs_read_in_millions_of_tokens_and_gpu_minutes_at_every_scale(tokens, hours, shown_tokens, shown_time):
    from harness import units

    assert units.tokens(tokens) == shown_tokens and units.gpu_time(hours) == shown_time


def test_a_bad_utilisation_is_refused():
    with pytest.raises(Exception, match=r"utilisation in \(0, 1\]"):
        Profile(utilisation=40)
