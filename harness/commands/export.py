"""``depthmem export``: a trained run as a Hugging Face model folder (Llama for PreLN, remote code otherwise)."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "export",
        help="write a run as a Hugging Face model folder that transformers and lm-eval --model hf load",
        description="PreLN becomes a plain LlamaForCausalLM checkpoint; every other variant a transformers model "
        "with remote code (load it and its tokenizer with trust_remote_code=True where depthmem is "
        "installed). The run's tokenizer is saved beside it; every file follows the umask.",
    )
    p.add_argument("run", metavar="RUN", help="run directory (or a .ckpt file beside its config.json)")
    p.add_argument("--hf", required=True, metavar="OUT", help="folder to write the model and tokenizer into")
    return p


def run(args) -> int:
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.model.export import export_hf

    out = export_hf(args.run, args.hf)
    print(
        f"depthmem: wrote {out} (load the model and the tokenizer with transformers' from_pretrained"
        + (
            ""
            if (out / "model.safetensors").exists() and "llama" in (out / "config.json").read_text()
            else ", trust_remote_code=True"
        )
        + ")"
    )
    return 0
