"""``depthmem bench --micro-batch-memory``: the memory of a whole training step against the micro batch, and the
largest micro batch a card holds."""

from __future__ import annotations

import pandas as pd
import pytest
from cli_checks import fails

from harness import build_model, model_preset
from harness.benchmarks import micro_batch as MB
from harness.cli import main

GIB = 1024**3


def test_fit_leaves_headroom_and_the_gradient_buckets_aside():
    # 40 GiB card, 15 % headroom: 34 GiB, less 2 GiB fixed and 4 bytes for each of 2**28 parameters (1 GiB).
    assert MB.fit(2 * GIB, 0.5 * GIB, 2**28, 40, 0.15) == 62
    assert MB.fit(2 * GIB, 0.5 * GIB, 2**28, 40, 0.0) == 74
    assert MB.fit(39 * GIB, 0.5 * GIB, 2**28, 40) == 0


@pytest.mark.slow
def test_step_memory_holds_weights_adam_state_and_grows_by_each_sequence(rng_seed):
    """Before anything runs a step holds weights and two AdamW moments (12 bytes a float32 parameter); each more
    sequence adds at least its float32 logits and their gradient."""
    cfg = model_preset("tiny")
    model = build_model(cfg, "preln")
    params = sum(p.numel() for p in model.parameters())
    seq = 32
    one, two = (MB.step_bytes(model, m, seq, dtype="float32") for m in (1, 2))
    assert one > 12 * params
    assert two - one >= 2 * seq * cfg.vocab_size * 4


def test_table_fits_a_line_through_the_measurements_for_every_variant(rng_seed):
    df = MB.micro_batch_memory(["preln", "ldm"], preset="tiny", seq_len=16, micro_batches=(1, 3))
    assert set(df.variant) == {"preln", "ldm"} and len(df) == 4
    for _, rows in df.groupby("variant"):
        line = rows.fixed_bytes + rows.bytes_per_sequence * rows.micro_batch
        assert (line - rows.peak_bytes).abs().max() < 1e-3 * rows.peak_bytes.max()  # two points: exactly on it
        assert (rows.bytes_per_sequence > 0).all()
    table = MB.fit_table(df, (40, 80))
    assert list(table.columns[-2:]) == ["fits_40GB", "fits_80GB"]
    assert (table.fits_80GB >= 2 * table.fits_40GB).all()
    peaks = df.pivot(index="micro_batch", columns="variant", values="peak_bytes")
    assert (peaks.ldm > peaks.preln).all()  # its query and key networks, and the writes it keeps


def test_cli_writes_both_tables(tmp_path, capsys):
    out = tmp_path / "fit"
    argv = ["bench", "--micro-batch-memory", "--preset", "tiny", "--seq", "16", "--variants", "preln"]
    assert main([*argv, "--micro-batches", "1,2", "--cards", "24", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fits_24GB" in printed
    assert len(pd.read_csv(out / "micro_batch.csv")) == 2
    assert pd.read_csv(out / "micro_batch_fit.csv").fits_24GB.iloc[0] > 0


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--micro-batches", "2"], "two or more distinct"),
        (["--micro-batches", "0,2"], "two or more distinct"),
        (["--seq", "16,32"], "one sequence length"),
        (["--headroom", "1.5"], "headroom"),
        (["--dtype", "fp16"], "float32 or bf16"),
    ],
)
def test_bad_settings_exit_2_before_measuring(extra, words, capsys, tmp_path):
    line = fails(capsys, ["bench", "--micro-batch-memory", "--preset", "tiny", "--out", str(tmp_path), *extra])
    assert words in line
    assert not any(tmp_path.iterdir())


def test_dry_run_names_the_defaults(capsys):
    assert main(["bench", "--micro-batch-memory", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "preset: gpt2-small" in out and "seq_len: 1024" in out and "dtype: bf16" in out
