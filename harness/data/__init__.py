"""Data: text corpora in, token shards and tokenizers out.

``corpus`` reads the built-in corpus, prepares shard folders from text, JSONL or Parquet (local or from the
hub) and serves training and validation windows; ``tokenizer`` holds the GPT-2 BPE and byte-level BPEs trained
and cached per corpus.
"""
