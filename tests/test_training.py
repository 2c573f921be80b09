"""Training: the run-directory contract, falling loss, determinism, divergence, checkpoint loading and the CLI."""

from __future__ import annotations

import csv
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

import variants
from harness import rundir
from harness.cli import main as cli_main
from harness.config import build_config, model_preset
from harness.data import corpus as D
from harness.data import shards
from harness.errors import RunFailed, UsageError
from harness.model.checkpoint import load_model
from harness.model.diagnostics import traced_forward
from harness.model.factory import build_model
from harness.training import trainer as trainer_module
from harness.training.optim import divergence, lr_factor, param_groups
from harness.training.runfiles import METRICS_COLUMNS
from harness.training.trainer import train

pytestmark = pytest.mark.usefixtures("shared_cache")


def tiny(steps: int, variant: str = "preln", **train) -> dict:
    t = dict(
        max_steps=steps,
        log_every_steps=1,
        val_every_steps=12,
        val_batches=2,
        ckpt_every_steps=12,
        batch_size=8,
        seq_len=32,
        warmup_steps=4,
    )
    t.update(train)
    return build_config({"variant": variant, "model": {"preset": "tiny"}, "train": t})


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def preln_run(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEPTHMEM_CACHE", str(tmp_path_factory.getbasetemp().parent / "depthmem-cache"))
        return train(tiny(24), tmp_path_factory.mktemp("preln") / "run")


def test_lr_schedule_matches_closed_form():
    kw = dict(total=100, warmup=10, min_ratio=0.1, decay_fraction=0.2)
    assert lr_factor(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(55, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(99, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert lr_factor(79, schedule="wsd", **kw) == 1.0
    assert lr_factor(89, schedule="wsd", **kw) == pytest.approx(1 - 0.9 * 10 / 20)
    assert lr_factor(99, schedule="wsd", **kw) == pytest.approx(0.1)


@pytest.mark.parametrize("variant", ["preln", "ldm-rls"])
def test_weight_decay_only_on_matrices_and_mixer_linear_weights(variant):
    if variant not in variants.names():
        pytest.skip(f"{variant} is not registered")
    model = build_model(tiny(1).model, variant)
    decay, no_decay = param_groups(model, 0.1)
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert sorted(ids) == sorted({id(p) for p in model.parameters()})  # each parameter exactly once
    decayed = {id(p) for p in decay["params"]}
    assert id(model.embed.weight) not in decayed
    for name, p in model.named_parameters():
        if "norm" in name or p.ndim < 2:
            assert id(p) not in decayed, name
    linear = {id(m.weight) for m in model.mixer.modules() if isinstance(m, torch.nn.Linear)}
    assert all((id(p) in decayed) == (id(p) in linear) for p in model.mixer.parameters())


@pytest.mark.slow
@pytest.mark.xdist_group("preln_run")  # one worker trains the shared run once
def test_run_directory_contract_and_falling_loss(preln_run):
    run = preln_run
    for name in (
        "config.json",
        "env.json",
        "status.json",
        "metrics.csv",
        "layers.csv",
        "summary.json",
        "mixing.json",
        "tokenizer.json",
        "ckpt/last.ckpt",
    ):
        assert (run / name).is_file(), name
    assert rundir.read_status(run)["state"] == "done" and rundir.read_status(run)["step"] == 24
    with open(run / "metrics.csv") as f:
        assert f.readline().strip().split(",") == METRICS_COLUMNS
    metrics = rows(run / "metrics.csv")
    assert [int(r["step"]) for r in metrics] == list(range(25))
    val = {int(r["step"]): float(r["val_loss"]) for r in metrics if r["val_loss"]}
    assert sorted(val) == [0, 12, 24]
    assert val[0] == pytest.approx(math.log(512), abs=0.2)  # an untrained model is close to uniform
    assert val[24] < val[0] - 0.4
    layers = rows(run / "layers.csv")
    assert {int(r["step"]) for r in layers} == {0, 12, 24} and len(layers) == 3 * 4
    summary = json.loads((run / "summary.json").read_text())
    for key in (
        "val_loss",
        "val_bpb",
        "val_ppl",
        "step",
        "tokens",
        "params",
        "extra_params",
        "stream_floats_per_token",
        "extra_flops_per_token",
        "tokens_per_s",
        "peak_mem_bytes",
        "wall_s",
    ):
        assert key in summary, key
    assert summary["val_loss"] == val[24] and summary["tokens"] == 24 * 8 * 32
    assert (summary["train_steps"], summary["train_tokens"]) == (24, 24 * 8 * 32)
    assert "depth_memory" not in summary and not (run / "depth_stats.jsonl").exists()  # PreLN learns no λ or ω
    assert summary["val_ppl"] == pytest.approx(math.exp(val[24]))
    # The training step's allocator peak, not the process's RSS (hundreds of MiB of interpreter and libraries):
    # above the weights, gradients and AdamW's two moments, far below the process.
    assert summary["peak_mem_method"] == "cpu" and 16 * summary["params"] < summary["peak_mem_bytes"] < 2**27
    assert isinstance(summary["cores_shared"], bool) and summary["cpu_cores"] >= 1
    mixing = json.loads((run / "mixing.json").read_text())
    assert len(mixing["matrix"]) == 5


@pytest.mark.slow
@pytest.mark.xdist_group("preln_run")  # one worker trains the shared run once
def test_validation_numbers_match_an_independent_recomputation(preln_run):
    """val_loss and val_bpb from a float64 pass of the loaded model over the same windows, bytes from decoding."""
    model, tok, cfg = load_model(preln_run)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    tokens = D.load_tokens(cfg, tok)
    windows = torch.from_numpy(D.val_windows(tokens.val, count=2 * 8, seq_len=32))  # (16, 33)
    model = model.double()
    with torch.no_grad():
        logits = model(windows[:, :-1])
    nats = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum").item()
    n_bytes = sum(len(tok.decode(w[1:].tolist()).encode("utf-8")) for w in windows)
    summary = json.loads((preln_run / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(nats / windows[:, 1:].numel(), rel=1e-5)
    assert summary["val_bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("preln_run")  # one worker trains the shared run once
def test_finished_run_returns_without_training(preln_run):
    before = (preln_run / "ckpt" / "last.ckpt").stat().st_mtime_ns, (preln_run / "metrics.csv").read_text()
    train(tiny(24), preln_run)
    assert ((preln_run / "ckpt" / "last.ckpt").stat().st_mtime_ns, (preln_run / "metrics.csv").read_text()) == before
    with pytest.raises(UsageError, match="different config"):
        train(tiny(25), preln_run)


@pytest.mark.slow
@pytest.mark.xdist_group("preln_run")  # one worker trains the shared run once
def test_load_model_rejects_corrupt_or_mismatched_checkpoints(preln_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(preln_run, run)
    model, _, _ = load_model(run / "ckpt" / "last.ckpt")
    assert model.num_params() == json.loads((run / "summary.json").read_text())["params"]
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["n_blocks"] = 3
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="does not match its config"):
        load_model(run)
    data = (preln_run / "ckpt" / "last.ckpt").read_bytes()
    (run / "ckpt" / "last.ckpt").write_bytes(data[: len(data) // 2])
    (run / "ckpt" / "last.previous.ckpt").unlink(missing_ok=True)  # no good checkpoint to fall back to
    with pytest.raises(UsageError, match="does not match the checksum written when it was saved"):
        load_model(run)
    # Without its checksum (a checkpoint saved before checksums were written) the reader finds the damage.
    (run / "ckpt" / "last.ckpt.sha256").unlink()
    with pytest.raises(UsageError, match="truncated or corrupt"):
        load_model(run)


@pytest.mark.slow
def test_other_variant_trains_and_writes_the_contract(tmp_path):
    run = train(tiny(3, "ldm-rls(groups=4)", val_every_steps=2, ckpt_every_steps=3), tmp_path / "run")
    assert rundir.read_status(run)["state"] == "done"
    assert all(math.isfinite(float(r["train_loss"])) for r in rows(run / "metrics.csv")[1:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 3
    # What LDM-RLS learned, at every validation and in the summary from the last one.
    records = [json.loads(line) for line in (run / "depth_stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 3]
    assert summary["depth_memory"] == {k: v for k, v in records[-1].items() if k != "step"}
    assert records[0]["lambda"] != records[-1]["lambda"]  # λ is learned, so it moved

    # Independently: λ from the trained θ in float64, ω by hand from the key MLPs on the residual stream.
    model, tok, cfg = load_model(run)
    mixer, L, G = model.mixer, model.n_layers, 4
    gain = cfg.variant.config.scalar_lr  # the logits are the parameters times the gain
    lam = 0.5 + 0.5 * torch.sigmoid(gain * mixer.theta.detach().double())  # (L, G)
    assert torch.tensor(summary["depth_memory"]["lambda"], dtype=torch.float64).shape == (L, G)
    torch.testing.assert_close(
        torch.tensor(summary["depth_memory"]["lambda"], dtype=torch.float64), lam, rtol=1e-12, atol=0
    )
    windows = torch.from_numpy(D.val_windows(D.load_tokens(cfg, tok).val, count=2 * 8, seq_len=32))[:4, :-1]
    model = model.double()
    _, trace = traced_forward(model, windows)  # the layer outputs v_l, so x_{l-1} = e + Σ_{i<l} v_i
    x = model.embed(windows).detach()
    for layer, key in enumerate(mixer.keys):
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * key.norm.weight
        z = F.linear(F.silu(F.linear(xn, key.fc1.weight, key.fc1.bias)), key.fc2.weight, key.fc2.bias)
        omega = 2 * torch.sigmoid(gain * z[..., -G:]).detach()  # (b, t, g): the key MLP's outputs after the G keys
        got = summary["depth_memory"]["omega"][layer]
        want = {"mean": omega.mean(), "std": omega.std(unbiased=False), "min": omega.min(), "max": omega.max()}
        for name, value in want.items():
            assert got[name] == pytest.approx(float(value), rel=1e-5, abs=1e-7), (layer, name)
        x = x + trace.outputs[layer]
    assert len(summary["depth_memory"]["omega"]) == L


@pytest.mark.slow
def test_same_config_and_seed_give_the_same_curve(tmp_path):
    curves = []
    for i, seed in enumerate((7, 7, 8)):
        cfg = tiny(3, seed=seed, val_batches=0)
        curves.append([r["train_loss"] for r in rows(train(cfg, tmp_path / f"r{i}") / "metrics.csv")])
    assert curves[0] == curves[1] and curves[0] != curves[2]


@pytest.mark.slow
def test_divergence_stops_the_run_with_status(tmp_path):
    with pytest.raises(RunFailed, match="diverged at step 1"):
        train(tiny(5, max_grad_norm_diverge=1e-4), tmp_path / "run")
    status = rundir.read_status(tmp_path / "run")
    assert status["state"] == "diverged" and status["step"] == 1
    assert not (tmp_path / "run" / "ckpt" / "last.ckpt").exists()


def test_divergence_names_its_kind():
    assert divergence(7, 5.25, 0.5, 1e4) is None
    assert divergence(7, math.nan, math.nan, 1e4) == "diverged at step 7 (loss nan, gradient norm nan)"
    assert divergence(7, math.inf, 3.0, 1e4) == "diverged at step 7 (loss inf, gradient norm 3)"
    assert divergence(7, 5.25, math.nan, 1e4) == "stopped on a non-finite gradient at step 7 with finite loss 5.25"
    assert divergence(7, 5.25, math.inf, 1e4) == "stopped on a non-finite gradient at step 7 with finite loss 5.25"
    assert divergence(7, 5.25, 2e4, 1e4) == (
        "diverged at step 7 (loss 5.25, gradient norm 2e+04 above train.max_grad_norm_diverge = 10000)"
    )


@pytest.mark.slow
def test_a_non_finite_gradient_at_a_finite_loss_is_named_in_the_status(tmp_path, monkeypatch):
    """A gradient that turns NaN while the loss stays finite, as a defect in a backward pass makes it (the third
    step's gradient of the embedding here), stops the run under its own name, not as a loss that blew up."""
    backward_passes = iter(range(1_000))

    def with_a_nan_gradient(model_cfg, variant):
        model = build_model(model_cfg, variant)
        model.embed.weight.register_hook(lambda g: g * math.nan if next(backward_passes) == 2 else g)
        return model

    monkeypatch.setattr(trainer_module, "build_model", with_a_nan_gradient)
    with pytest.raises(RunFailed, match=r"The run stopped on a non-finite gradient at step 3 with finite loss \d"):
        train(tiny(5), tmp_path / "run")
    status = rundir.read_status(tmp_path / "run")
    assert status["state"] == "diverged" and status["step"] == 3
    assert status["message"].startswith("stopped on a non-finite gradient at step 3 with finite loss ")
    assert math.isfinite(status["last_loss"])


@pytest.mark.slow
def test_training_on_prepared_shards(tmp_path):
    texts = [text[:20_000] for _, text in D.shakespeare_documents()[:6]]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    from harness.data import tokenizer as toklib

    (tmp_path / "tok.json").write_text(toklib.train_bpe(texts, 512).to_json())
    shards.prepare(
        [str(tmp_path / f"{i}.txt") for i in range(6)],
        tmp_path / "shards",
        tokenizer=str(tmp_path / "tok.json"),
        progress=False,
    )
    cfg = build_config(tiny(2).to_dict(), {"data": {"corpus": str(tmp_path / "shards"), "val_fraction": 0.2}})
    run = train(cfg, tmp_path / "run")
    assert rundir.read_status(run)["state"] == "done"
    _, tok, _ = load_model(run)
    assert tok.to_json() == (tmp_path / "shards" / "tokenizer.json").read_text()


def test_cli_dry_run_and_usage_errors(tmp_path, capsys):
    assert (
        cli_main(
            [
                "train",
                "--variant",
                "preln",
                "--preset",
                "tiny",
                "--out",
                str(tmp_path / "r"),
                "--max-steps",
                "7",
                "--set",
                "train.lr=1e-3",
                "--dry-run",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["variant"] == "preln" and printed["train"]["max_steps"] == 7 and printed["train"]["lr"] == 1e-3
    assert not (tmp_path / "r").exists()
    (tmp_path / "file").write_text("")
    assert cli_main(["train", "--preset", "tiny", "--out", str(tmp_path / "file" / "r"), "--max-steps", "1"]) == 2
    assert "run directory" in capsys.readouterr().err
    assert cli_main(["train", "--variant", "no-such-mixer", "--out", str(tmp_path / "r")]) == 2
    assert cli_main(["train", "--preset", "tiny", "--out", str(tmp_path / "r"), "--set", "data.corpus=nowhere"]) == 2
    assert "neither an embedded corpus" in capsys.readouterr().err


def test_global_grad_norm_matches_the_float64_norm(rng_seed):
    from harness.training.optim import global_grad_norm

    grads = [torch.randn(3 * 4096 + 17), torch.randn(64, 96) * 1e-3, torch.randn(5), torch.randn(2, 4096) * 50]
    exact = float(torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])))
    assert global_grad_norm(grads) == pytest.approx(exact, rel=1e-6)
    as64 = [g.double() for g in grads]
    assert global_grad_norm(as64) == pytest.approx(exact, rel=1e-13)
    assert global_grad_norm([g.bfloat16() for g in grads]) == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([g.bfloat16().double().flatten() for g in grads]))), rel=1e-5
    )


def test_layer_grad_norms_match_float64_and_stay_a_device_tensor(rng_seed):
    from harness.training.optim import layer_grad_norms

    torch.manual_seed(rng_seed)
    model = build_model(model_preset("tiny"), "ldm-rls")
    idx = torch.randint(0, model.cfg.vocab_size, (2, 17))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    model.layers[1].norm.weight.grad = None  # a parameter without a gradient yet counts nothing
    norms = layer_grad_norms(model)
    assert isinstance(norms, torch.Tensor) and norms.shape == (model.n_layers,)
    for layer, got in zip(model.layers, norms.tolist()):
        grads = [p.grad.double().flatten() for p in layer.parameters() if p.grad is not None]
        assert got == pytest.approx(float(torch.linalg.vector_norm(torch.cat(grads))), rel=1e-6)
    for p in model.parameters():
        p.grad = None
    assert layer_grad_norms(model).tolist() == [0.0] * model.n_layers


def test_budget_is_the_same_for_every_variant_of_a_size():
    from harness.model.costs import preln_params
    from harness.model.factory import build_model
    from harness.training.optim import total_steps

    assert total_steps(tiny(7)) == 7
    assert total_steps(tiny(0, tokens=1000)) == math.ceil(1000 / (8 * 32))
    for name in ("preln", "ldm-rls", "hc"):
        cfg = tiny(0, name, tokens_per_param=0.5)
        # Counted against PreLN at this size, not against the variant's own (larger) parameter count.
        assert build_model(cfg.model, name).num_params() >= preln_params(cfg.model)
        assert total_steps(cfg) == math.ceil(0.5 * build_model(cfg.model, "preln").num_params() / (8 * 32))
    with pytest.raises(UsageError, match="both fix the budget"):
        tiny(3, tokens=1000)
