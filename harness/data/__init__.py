"""Data: text corpora in, token shards and tokenizers out.

``shards`` prepares shard folders from text, JSONL or Parquet (local or from the hub); ``corpus`` reads the
built-in corpus and shard folders and serves training and validation windows; ``tokenizer`` holds the GPT-2 BPE
and byte-level BPEs trained and cached per corpus.
"""
