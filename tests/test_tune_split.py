"""The tuning split: carved from the training stream, disjoint from the validation split and from every training
window of a run that validates on it; the validation split and the runs on it stay as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.config import build_config
from harness.data import corpus as D
from harness.data.shards import INDEX_FORMAT
from harness.errors import UsageError
from harness.rundir import config_hash

EOT = 4_000_000_000  # never a position, so every other token's value is its position in the corpus


@pytest.fixture
def positional_shards(tmp_path):
    """A shard folder whose token at position i is i, with a document end every 37 tokens."""
    n = 20_000
    tokens = np.arange(n, dtype=np.uint32)
    tokens[36::37] = EOT
    folder = tmp_path / "shards"
    folder.mkdir()
    half = n // 2
    shards = []
    for k, part in enumerate((tokens[:half], tokens[half:])):
        (folder / f"shard_{k:05d}.bin").write_bytes(part.tobytes())
        shards.append({"file": f"shard_{k:05d}.bin", "tokens": len(part), "documents": 0})
    index = {"format": INDEX_FORMAT, "dtype": "uint32", "shards": shards, "eot_id": EOT, "tokenizer": "gpt2"}
    (folder / "index.json").write_text(json.dumps(index))
    return folder


def _positions(tokens: D.Tokens) -> set[int]:
    values = tokens.window(0, len(tokens))
    return set(values[values != EOT].tolist())


def _cfg(corpus, split):
    return build_config({"model": {"preset": "tiny"}, "data": {"corpus": str(corpus), "eval_split": split}})


def test_tune_split_is_disjoint_from_val_and_from_every_training_window(positional_shards):
    on_val = D.load_tokens(_cfg(positional_shards, "val"), None)
    on_tune = D.load_tokens(_cfg(positional_shards, "tune"), None)
    assert on_val.split == "val" and on_tune.split == "tune"
    val, tune, train = _positions(on_val.val), _positions(on_tune.val), _positions(on_tune.train)
    assert tune and val and tune.isdisjoint(val) and tune.isdisjoint(train) and val.isdisjoint(train)
    # Carved from the training stream: a run on val trains on the tuning tokens, a run on tune does not.
    assert tune <= _positions(on_val.train)
    assert _positions(on_val.train) == train | tune
    # The tuning split starts right after a document's end.
    assert int(on_tune.val.window(0, 1)[0]) % 37 == 0
    seen: set[int] = set()
    for step in range(50):
        batch = D.train_batch(on_tune.train, seed=3, step=step, batch_size=8, seq_len=64)
        seen |= set(batch[batch != EOT].tolist())
    assert seen and seen.isdisjoint(tune) and seen.isdisjoint(val)


def test_shakespeare_tune_split_holds_other_documents_than_val_and_train():
    names = [n for n, _ in D.shakespeare_documents()]
    train, val = D.split_names(names, 0.05)
    rest, tune = D.split_names(train, 0.05)
    assert tune and set(tune).isdisjoint(val) and set(tune).isdisjoint(rest)
    assert sorted(rest + tune + val) == sorted(names)
    cfg = _cfg("shakespeare", "tune")
    tok = D.get_tokenizer(cfg)
    on_tune, on_val = D.load_tokens(cfg, tok), D.load_tokens(_cfg("shakespeare", "val"), tok)

    def spans(tokens):  # byte ranges of the documents' views of one cached token file
        return [(p.ctypes.data, p.ctypes.data + p.nbytes) for p in tokens.parts]

    held = spans(on_tune.val)
    for lo, hi in spans(on_tune.train) + spans(on_val.val):
        assert all(hi <= a or lo >= b for a, b in held)
    assert len(on_tune.train) + len(on_tune.val) == len(on_val.train)


def test_eval_split_is_checked_and_the_default_keeps_run_ids():
    with pytest.raises(UsageError, match="data.eval_split must be one of val, tune"):
        build_config({"data": {"eval_split": "test"}})
    default, explicit = build_config({}), build_config({"data": {"eval_split": "val"}})
    assert config_hash(default) == config_hash(explicit)
    assert config_hash(build_config({"data": {"eval_split": "tune"}})) != config_hash(default)
