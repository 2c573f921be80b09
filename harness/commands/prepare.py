"""``depthmem prepare``: tokenize text, JSONL or Parquet files (or a hub dataset) into a folder of token shards."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "prepare",
        help="tokenize documents into token shards for training (data.corpus=DIR)",
        description="Tokenize documents into flat uint16/uint32 token shards plus index.json, each document "
        "followed by the end-of-text token. Train on them with data.corpus=DIR.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files (one document each), .jsonl (one per line) or .parquet (one per row) files or "
        "glob patterns of them (quote them: 'data/*.parquet'), or a Hugging Face dataset: a hub "
        "name (needs the network) or a local folder laid out like one",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the shards and index.json into")
    p.add_argument(
        "--tokenizer",
        default="gpt2",
        metavar="gpt2|bpe:N|PATH",
        help="gpt2 (default), bpe:N (a byte-level BPE of N tokens trained on the inputs), or the path "
        "of a Hugging Face tokenizer.json (copied into DIR)",
    )
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="the model preset the corpus is for: a tokenizer larger than its vocabulary is refused "
        "before any work, naming the model.vocab_size to use",
    )
    p.add_argument("--text-field", default="text", help="JSONL field, Parquet column or dataset field (default: text)")
    p.add_argument("--split", default="train", help="split of a hub dataset (default: train)")
    p.add_argument(
        "--subset",
        default=None,
        metavar="NAME",
        help="config (subset) of a hub dataset, e.g. sample-10BT of HuggingFaceFW/fineweb-edu",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="stop at the end of the document that reaches N tokens (default: everything)",
    )
    p.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="start over even if DIR holds an interrupted preparation with the same arguments",
    )
    p.add_argument("--shard-tokens", type=int, default=50_000_000, help="tokens per shard (default: 50,000,000)")
    p.add_argument("--dry-run", action="store_true", help="print what would be prepared and exit")
    return p


def run(args) -> int:
    import json

    if args.dry_run:
        print(json.dumps({k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}, indent=2))
        return 0
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.data.corpus import read_index
    from harness.data.shards import prepare

    out = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        split=args.split,
        config=args.subset,
        max_tokens=args.max_tokens,
        shard_tokens=args.shard_tokens,
        resume=args.resume,
        preset=args.preset,
    )
    index = read_index(out)
    print(
        f"depthmem: {index['documents']:,} documents, {index['tokens']:,} tokens in {len(index['shards'])} "
        f"shard(s) at {out}; train on it with data.corpus={out} model.vocab_size={index['vocab_size']}"
    )
    return 0
