"""The cost benchmark: outputs for every variant, same-run ratios, memory accounting, floors and scaling fits.

Nothing here asserts a time: the machine is shared. Memory, FLOPs and fits are checked against independent
counts (known allocations, torch's FlopCounterMode, exponents of synthetic power laws).
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import variants
from harness.benchmarks import benchmark as B
from harness.benchmarks import memory, outputs, quiet, reference, targets
from harness.cli import main
from harness.errors import UsageError
from harness.model.factory import build_model

REQUIRED = [
    "variant",
    "depth",
    "width",
    "seq_len",
    "batch_size",
    "device",
    "dtype",
    "step_time_ms",
    "tokens_per_s",
    "peak_mem_bytes",
    "ratio_time",
    "ratio_mem",
    "floor_flops_per_token",
    "floor_state_bytes_per_token",
    "target",
    "met",
    "threads",
    "vocab_size",
]


def _tiny(**kw):
    """A bench call small enough for a busy two-core machine."""
    args = dict(preset="tiny", depths=(2,), seqs=(8,), batch_size=1, repeats=1, warmup=0)
    args.update(kw)
    return B.bench(**args)


@pytest.mark.slow
def test_quick_cli_writes_csv_plot_and_a_row_for_every_registered_variant(tmp_path, capsys):
    """``--quick`` runs every registered variant once and writes the CSV, the fits and a readable PNG."""
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--batch-size", "1", "--seq", "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    df = pd.read_csv(out / "bench.csv")
    assert set(REQUIRED) <= set(df.columns)
    assert sorted(df["variant"]) == sorted(variants.names())
    assert (df["depth"] == 4).all() and (df["seq_len"] == 16).all() and (df["batch_size"] == 1).all()
    assert (df["step_time_ms"] > 0).all() and (df["peak_mem_bytes"] > 0).all()
    assert df.loc[df["variant"] == "preln", ["ratio_time", "ratio_mem"]].to_numpy().tolist() == [[1.0, 1.0]]
    fits = pd.read_csv(out / "bench_scaling.csv")
    assert sorted(fits["variant"]) == sorted(n for n in variants.names() if n != "preln")
    png = (out / "overhead_vs_depth.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    import matplotlib.image

    assert matplotlib.image.imread(out / "overhead_vs_depth.png").shape[0] > 100
    for name in variants.names():
        assert name in printed
    assert "target" in printed and "threads" in printed
    meta = json.loads((out / "bench_meta.json").read_text())
    assert meta["git_revision"] is None or len(meta["git_revision"].split("-")[0]) == 40  # which code was measured


@pytest.mark.slow
def test_ratios_and_rates_come_from_the_same_run(rng_seed):
    """Each row's ratios divide by PreLN's numbers at the same shape, and the thread setting is restored."""
    other = next(n for n in variants.names() if n != "preln") if len(variants.names()) > 1 else "preln"
    before = torch.get_num_threads()
    df = _tiny(variants=[other], depths=(2, 4), threads=1, seed=rng_seed % 1000)
    assert torch.get_num_threads() == before
    assert len(df) == 2 * len({"preln", other})
    assert (df["threads"] == 1).all()
    for depth, rows in df.groupby("depth"):
        base = rows[rows["variant"] == "preln"].iloc[0]
        for _, row in rows.iterrows():
            assert row["ratio_mem"] == pytest.approx(row["peak_mem_bytes"] / base["peak_mem_bytes"])
            assert row["extra_mem_bytes"] == row["peak_mem_bytes"] - base["peak_mem_bytes"]
            assert row["tokens_per_s"] == pytest.approx(1 * 8 / (row["step_time_ms"] / 1e3))
            # A step must hold at least the model and everything saved for backward at once.
            model = build_model(B.model_config("tiny", B.Shape(depth, 64, 8)), row["variant"])
            assert row["peak_mem_bytes"] >= memory.static_bytes(model) + row["saved_activation_bytes"]


@pytest.mark.slow
def test_same_seed_gives_the_same_memory_and_floors():
    """Memory and floors do not depend on timing noise: two identical runs agree exactly."""
    cols = ["variant", "peak_mem_bytes", "saved_activation_bytes", "floor_time_ratio", "floor_state_ratio"]
    a, b = _tiny(variants=["preln"], seed=3), _tiny(variants=["preln"], seed=3)
    pd.testing.assert_frame_equal(a[cols], b[cols])


def test_schedule_puts_every_variant_between_two_preln_steps():
    order_names = ["preln", "a", "b", "c"]
    rounds = B.schedule(order_names, 3)
    assert len(rounds) == 3
    for order in rounds:
        assert sorted(n for n in order if n != "preln") == ["a", "b", "c"]
        for i, name in enumerate(order):
            if name != "preln":
                assert order[i - 1] == "preln" and order[i + 1] == "preln"
    assert rounds[0][1] == "a" and rounds[1][1] == "c"  # alternating direction spreads position effects


def test_cpu_peak_counts_exactly_the_bytes_live_at_once(rng_seed):
    """The profiler-based peak equals the largest sum of simultaneously live allocations."""
    g = torch.Generator().manual_seed(rng_seed)
    a_n, b_n, c_n = (int(x) * 64 for x in torch.randint(1_000, 50_000, (3,), generator=g))

    def work():
        a = torch.empty(a_n, dtype=torch.uint8)
        b = torch.empty(b_n, dtype=torch.uint8)
        del a
        c = torch.empty(c_n, dtype=torch.uint8)
        return b, c

    assert memory.cpu_peak_allocated_bytes(work) == max(a_n + b_n, b_n + c_n)


def test_saved_activation_bytes_counts_inputs_autograd_keeps(rng_seed):
    """For tanh(x @ W) with W a parameter, backward keeps x (for W's gradient) and tanh's output."""
    x = torch.randn(7, 5)
    w = torch.nn.Parameter(torch.randn(5, 3))
    with memory.saved_activation_bytes(exclude=[w]) as saved:
        y = (x @ w).tanh()
    assert saved["bytes"] == x.nbytes + y.nbytes


def test_model_flops_match_torch_flop_counter(rng_seed):
    """The analytic PreLN FLOPs equal FlopCounterMode's count of the projections, MLP and head plus the
    attention products counted from explicit matmuls of the same shapes."""
    g = torch.Generator().manual_seed(rng_seed)
    heads = 4
    width = heads * 2 * int(torch.randint(2, 8, (1,), generator=g))
    depth, seq, batch, vocab = 2 * int(torch.randint(1, 4, (1,), generator=g)), 12, 2, 97
    cfg = B.model_config("tiny", B.Shape(depth, width, seq), vocab)
    model = build_model(cfg, "preln")
    idx = torch.randint(vocab, (batch, seq), generator=g)
    with FlopCounterMode(display=False) as counted:
        model(idx)
    # FlopCounterMode does not see inside CPU scaled_dot_product_attention: count q·kᵀ and weights·v directly.
    q = torch.randn(batch, heads, seq, width // heads)
    with FlopCounterMode(display=False) as attention:
        torch.matmul(torch.matmul(q, q.transpose(-1, -2)), q)
    total = counted.get_total_flops() + cfg.n_blocks * attention.get_total_flops()
    assert targets.model_flops_per_token(cfg, seq) == total / (batch * seq)


def test_preln_floor_is_the_plain_residual():
    cfg = B.model_config("small", B.Shape(12, 256, 256))
    mixer = variants.build("preln", d_model=256, n_layers=12)
    floor = targets.analytic_floor(mixer, cfg, 256)
    assert floor["floor_flops_per_token"] == 0 and floor["floor_time_ratio"] == 1.0
    assert floor["floor_state_bytes_per_token"] == 4 * 256 and floor["floor_state_ratio"] == 1.0


def test_scaling_recovers_known_power_laws(rng_seed):
    """On data that follows extra time = c·L^1.5·T^0.5 and extra memory = k·L, the fit returns those exponents."""
    g = torch.Generator().manual_seed(rng_seed)
    c, k = float(torch.rand(1, generator=g)) + 0.1, float(torch.rand(1, generator=g)) * 1e6 + 1
    rows = []
    for L in (4, 8, 16, 32):
        for T in (64, 256):
            rows.append(
                {
                    "variant": "x",
                    "depth": L,
                    "width": 128,
                    "seq_len": T,
                    "extra_time_ms": c * L**1.5 * T**0.5,
                    "extra_mem_bytes": k * L,
                }
            )
    rows.append(
        {"variant": "preln", "depth": 4, "width": 128, "seq_len": 64, "extra_time_ms": 0.0, "extra_mem_bytes": 0}
    )
    fits = outputs.scaling(pd.DataFrame(rows)).set_index("variant")
    assert list(fits.index) == ["x"]
    assert fits.loc["x", "time_exp_depth"] == pytest.approx(1.5, abs=1e-9)
    assert fits.loc["x", "time_exp_seq_len"] == pytest.approx(0.5, abs=1e-9)
    assert math.isnan(fits.loc["x", "time_exp_width"])
    assert fits.loc["x", "mem_exp_depth"] == pytest.approx(1.0, abs=1e-9)
    line = outputs.scaling_lines(outputs.scaling(pd.DataFrame(rows)))[0]
    assert line.startswith("x: extra time ∝ L^1.50 · T^0.50")


@pytest.mark.parametrize(
    "varying, axis",
    [
        ((), "depth"),
        (("depth", "width"), "depth"),
        (("width",), "width"),
        (("seq_len",), "seq_len"),
        (("width", "seq_len"), "width"),
    ],
)
@pytest.mark.slow
def test_the_plot_runs_along_the_axis_that_varies(varying, axis, tmp_path):
    rows = []
    for i in range(3):
        shape = {a: (2 ** (i + 3) if a in varying else 64) for a in ("depth", "width", "seq_len")}
        for name, ratio in (("preln", 1.0), ("ldm", 1.1 + 0.1 * i)):
            rows.append({"variant": name, **shape, "ratio_time": ratio, "ratio_mem": ratio})
    df = pd.DataFrame(rows)
    assert outputs.plot_axis(df) == axis
    path = outputs.plot_overhead(df, tmp_path / "plot.png")
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[0] > 100


def test_targets_are_marked_met_or_not():
    text, mark = targets.target_of("ldm")
    assert "1.10" in text and "1.20" in text
    assert mark(1.05, 1.19) == "met" and mark(1.11, 1.0) == "not met" and mark(1.0, 1.21) == "not met"
    text, mark = targets.target_of("attnres", 48)
    assert "1.30x time at L=48" in text and mark(1.29, 1.29) == "met" and mark(1.31, 1.0) == "not met"
    text, mark = targets.target_of("attnres", 16)
    assert "growth with depth" in text and mark(5.0, 1.29) == "met" and mark(1.0, 1.31) == "not met"
    assert "plain trunk" in targets.target_of("preln")[0]
    assert targets.target_of("ldm-rls(groups=4)")[0] == ""


def test_schedule_times_each_variant_next_to_its_reference():
    rounds = B.schedule(["preln", "a", "b"], 2, references=["preln", "a"])
    assert rounds[0] == ["preln", "preln:reference", "preln", "a", "a:reference", "preln", "b", "preln"]
    assert rounds[1] == ["preln", "b", "preln", "a:reference", "a", "preln", "preln:reference", "preln"]


@pytest.mark.slow
def test_plain_trunk_and_reference_models_compute_what_the_variant_computes(rng_seed):
    """The references timed beside each variant are the same function: the plain trunk equals PreLN, and every
    mixer's reference implementation equals its fast path (float64, same weights). A mixer that runs one
    implementation has none."""
    idx = torch.randint(0, 512, (2, 16))
    for name in variants.names():
        model = build_model(B.model_config("tiny", B.Shape(4, 64, 16)), name).to(torch.float64)
        with torch.no_grad():
            for p in model.mixer.parameters():
                p.add_(0.1 * torch.randn_like(p))
        ref = reference.reference_model(name, model)
        if name != "preln" and not hasattr(model.mixer, "impl"):
            assert ref is None, f"{name} runs one implementation, yet a reference was built beside it"
            continue
        assert ref is not None, f"{name} has no reference implementation to be measured against"
        ref_model, impl = ref
        if name != "preln":
            assert impl != model.mixer.impl and ref_model.mixer.impl == impl
        torch.testing.assert_close(ref_model(idx), model(idx), rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
def test_reference_ratios_are_reported_for_every_variant(rng_seed):
    df = _tiny(variants=["hc"]).set_index("variant")
    assert df.loc["preln", "ref_impl"] == "plain pre-norm trunk"
    assert df.loc["preln", "ratio_time_vs_ref"] > 0 and df.loc["preln", "ratio_mem_vs_ref"] > 0
    assert df.loc["preln", "vs_ref"] in {"ok", "slower"}
    assert df.loc["hc", "ref_impl"] == "" and df.loc["hc", "vs_ref"] == ""  # one implementation: none beside it
    assert _tiny(variants=["hc"], references=False)["ref_impl"].eq("").all()


@pytest.mark.slow
def test_busy_machine_is_marked_and_refused_for_reference_numbers(monkeypatch, tmp_path):
    monkeypatch.setattr(quiet, "others_now", lambda seconds=1.0: 3.0)
    with pytest.raises(B.RunFailed, match="busy"):
        _tiny(variants=["preln"], require_quiet=True, out_dir=tmp_path / "b")
    assert not (tmp_path / "b").exists()
    df = _tiny(variants=["preln"], out_dir=tmp_path / "c")
    assert df.attrs["meta"]["busy"] is True and df.attrs["meta"]["others_before"] == 3.0
    assert '"busy": true' in (tmp_path / "c" / "bench_meta.json").read_text()
    # Quiet before, then 1000 CPU seconds of other processes' work during the run: refused, nothing written.
    monkeypatch.setattr(quiet, "others_now", lambda seconds=1.0: 0.0)
    calls = itertools.count()
    monkeypatch.setattr(quiet, "machine_busy_seconds", lambda: 1000.0 * next(calls))
    monkeypatch.setattr(quiet, "own_seconds", lambda: 0.0)
    with pytest.raises(B.RunFailed, match="became busy"):
        _tiny(variants=["preln"], require_quiet=True, out_dir=tmp_path / "d")
    assert not (tmp_path / "d" / "bench.csv").exists()


@pytest.mark.slow
def test_other_processes_cpu_time_is_measured_apart_from_our_own():
    """A spinning child process shows as another core's worth of work; this process's own spinning does not."""
    if quiet.machine_busy_seconds() is None:
        pytest.skip("this machine has no /proc/stat to read CPU time from")
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)  # past the interpreter's start-up
        assert quiet.others_now(1.5) >= 0.6
    finally:
        spinner.wait()
    # Spin here instead, on the main thread: its time is ours, so everything else stays what it was. Another test
    # process may keep up to one core busy beside this one.
    cores = B.os.cpu_count()
    with quiet.OtherLoad() as load:
        t = time.time()
        while time.time() - t < 1.5:
            pass
    assert load.others is not None and load.others < max(cores, 2) - 0.5
    assert quiet.is_busy(0.1, None, quiet.OTHERS_LIMIT + 0.01) and not quiet.is_busy(0.1, None)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(depths=(3,)), "even"),
        (dict(variants=["no-such-mixer"]), "Known"),
        (dict(dtype="fp16"), "float32, bf16"),
        (dict(device="tpu"), "cpu, cuda"),
        (dict(repeats=0), "--repeats"),
        (dict(vocab=1), "--vocab"),
        (dict(widths=(30,)), "divisible"),
        (dict(seqs=(0,)), "--seq"),
    ],
)
def test_bad_settings_fail_before_measuring(kwargs, words):
    with pytest.raises(UsageError, match=words):
        _tiny(**kwargs)


def test_cli_bad_list_exits_2_with_one_sentence(capsys):
    assert main(["bench", "--depths", "8,x"]) == 2
    err = capsys.readouterr().err
    assert "comma-separated integers" in err and "Traceback" not in err


def test_variant_list_keeps_knob_commas_together():
    from harness.commands.bench import variant_list

    assert variant_list("ldm-rls(groups=4,lambda=1.0),hc, preln") == ["ldm-rls(groups=4,lambda=1.0)", "hc", "preln"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "2"], "--steps must be an integer of at least 3"),
        (["--val-every", "0"], "--val-every"),
        (["--seq", "128,256"], "one sequence length"),
        (["--variants", "no-such-mixer"], "Known"),
        (["--repeats", "0"], "--repeats must be an integer of at least 1"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
    ],
)
def test_loop_bench_bad_settings_exit_2_before_training(argv, words, capsys, tmp_path):
    assert main(["bench", "--loop", "--preset", "tiny", "--out", str(tmp_path / "loop"), *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "loop").exists()


@pytest.mark.slow
def test_loop_bench_alternates_bare_and_harness_runs(monkeypatch, tmp_path):
    """Two harness runs between three bare runs; the cost is the median of each against its two neighbours."""
    from harness.benchmarks import loop as LB

    bare_times, harness_times = iter([1.0, 3.0, 1.0]), iter([2.2, 2.0])
    real_bare, real_harness = LB.bare_loop, LB.harness_loop
    calls = []

    def bare(cfg, steps):
        calls.append("bare")
        real_bare(cfg, steps)  # the real loop runs; its time is replaced so the arithmetic can be checked
        return next(bare_times)

    def harness(cfg, run_dir):
        calls.append("harness")
        seconds, wall = real_harness(cfg, run_dir)
        assert seconds > 0 and wall >= seconds
        return next(harness_times), wall

    monkeypatch.setattr(LB, "bare_loop", bare)
    monkeypatch.setattr(LB, "harness_loop", harness)
    df = LB.loop_bench(
        ["preln"], preset="tiny", steps=4, log_every=1, val_every=2, val_batches=1, ckpt_every=2, batch_size=2,
        seq_len=16, rounds=2, out_dir=tmp_path,
    )  # fmt: skip
    assert calls == ["bare", "harness", "bare", "harness", "bare"]
    row = df.iloc[0]
    # Round costs 2.2 / 2 - 1 = 0.1 and 2.0 / 2 - 1 = 0; their median is 0.05.
    assert row["harness_cost"] == pytest.approx(0.05) and row["rounds"] == 2
    assert row["bare_spread"] == pytest.approx(2.0 / (5.0 / 3))
    assert isinstance(row["others_during"], float) or row["others_during"] is None
    written = pd.read_csv(tmp_path / "loop_bench.csv")
    assert list(written.columns) == LB.COLUMNS and len(written) == 1
