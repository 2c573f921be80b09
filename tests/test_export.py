"""``depthmem export RUN --hf OUT``: transformers loads the folder and gives the run's own logits."""

from __future__ import annotations

import json

import pytest
import torch

from harness.cli import main
from harness.config import build_config
from harness.model.checkpoint import load_model
from harness.training.trainer import train

# Every test exports a run trained first.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

SETTINGS = {
    "max_steps": 3,
    "log_every_steps": 1,
    "val_every_steps": 3,
    "val_batches": 1,
    "ckpt_every_steps": 3,
    "seq_len": 32,
    "batch_size": 4,
    "warmup_steps": 1,
}


def _trained(tmp_path, variant: str, tie: bool = True):
    cfg = build_config({"model": {"preset": "tiny", "tie_embeddings": tie}, "variant": variant, "train": SETTINGS})
    return train(cfg, tmp_path / variant)


@pytest.mark.parametrize("tie", [True, False])
def test_preln_exports_as_a_plain_llama(tmp_path, tie):
    run = _trained(tmp_path, "preln", tie)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert not list(out.glob("*.py"))  # no remote code
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    model, tok, _ = load_model(run)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "To be, or not to be, that is the question"
    ids = hf_tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tok.encode(text)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 32))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert (theirs - ours).abs().max() < 1e-4 * ours.abs().max()


@pytest.mark.parametrize("variant", ["ldm-rls", "mhc"])
def test_other_variants_export_with_remote_code(tmp_path, variant):
    run = _trained(tmp_path, variant)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "depthmem" and "AutoModelForCausalLM" in config["auto_map"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    model, _, _ = load_model(run)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 32))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert torch.equal(ours, theirs)


def test_export_files_follow_the_umask_and_the_tokenizer_loads_without_a_prompt(tmp_path):
    """Colleagues can read every exported file, and the tokenizer of a remote-code export loads, with the
    config's own model type, without asking anything on standard input."""
    import os
    import subprocess
    import sys

    run = _trained(tmp_path, "ldm-rls")
    out = tmp_path / "hf"
    old = os.umask(0o027)
    try:
        assert main(["export", str(run), "--hf", str(out)]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o640"}, modes
    code = (
        "import sys, transformers\n"
        "transformers.logging.set_verbosity_warning()\n"
        "tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "cfg = transformers.AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(tok.eos_token, cfg.model_type)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["<|endoftext|>", "depthmem"]
    assert "custom code" not in done.stderr and "model of type" not in done.stderr, done.stderr


def test_lm_eval_hf_backend_scores_an_export_as_the_project_does(tmp_path):
    """lm-eval's own ``hf`` model on the exported folder gives the per-item scores of the project's adapter."""
    pytest.importorskip("accelerate")
    from harness.evaluation.evaluator import run_tasks
    from harness.evaluation.lm_adapter import DepthmemLM

    run = _trained(tmp_path, "ldm-rls")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    ours = run_tasks(DepthmemLM(str(run), batch_size=4), ["offline_copa"], limit=12, bootstrap_iters=0)
    import lm_eval

    from harness.evaluation.evaluator import task_manager

    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},trust_remote_code=True,dtype=float32",
        tasks=["offline_copa"],
        task_manager=task_manager(["offline_copa"]),
        limit=12,
        bootstrap_iters=0,
        device="cpu",
        batch_size=4,
        log_samples=False,
    )
    metrics = [k for k in ours["results"]["offline_copa"] if k.startswith("acc") and "stderr" not in k]
    assert metrics
    for metric in metrics:
        assert theirs["results"]["offline_copa"][metric] == ours["results"]["offline_copa"][metric], metric


def test_export_in_a_terminal_prints_its_one_line_and_no_bar(tmp_path):
    """In a terminal (a pseudo-terminal here) transformers would draw and erase a progress bar while it writes."""
    import os
    import pty
    import sys

    run = _trained(tmp_path, "preln")
    out = tmp_path / "hf"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command line, its output on the terminal
        os.execv(sys.executable, [sys.executable, "-m", "harness.cli", "export", str(run), "--hf", str(out)])
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    text = b"".join(chunks).decode()
    assert text == f"depthmem: wrote {out} (load the model and the tokenizer with transformers' from_pretrained)\r\n"
