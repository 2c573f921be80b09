"""``depthmem prepare`` at scale, offline: a local folder laid out like a hub dataset (configs in README.md,
Parquet shards), a subset and a split, a token cap, glob patterns, and resuming an interrupted preparation."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.cli import main as cli_main
from harness.data import corpus as D
from harness.data import shards
from harness.data import tokenizer as toklib
from harness.errors import UsageError

WORDS = "the of depth memory layer stream residual mixing token attention norm gate value key query".split()


def _docs(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 60))) for _ in range(n)]


@pytest.fixture
def hub_folder(tmp_path, rng_seed, monkeypatch):
    """``sample-10BT`` (two Parquet files) and ``other`` (a JSONL file) configs, as the hub lays them out."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rng = random.Random(rng_seed)
    root = tmp_path / "fineweb-like"
    (root / "sample" / "10BT").mkdir(parents=True)
    (root / "other").mkdir()
    sample = [_docs(rng, 70), _docs(rng, 50)]
    for k, part in enumerate(sample):
        pq.write_table(
            pa.table({"text": part, "id": [f"{k}-{i}" for i in range(len(part))]}),
            root / "sample" / "10BT" / f"{k:03d}_00000.parquet",
        )
    (root / "other" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(rng, 5)))
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: sample/10BT/*.parquet\n"
        "- config_name: other\n  data_files:\n  - split: train\n    path: other/*.jsonl\n---\n# A test corpus\n"
    )
    tok = tmp_path / "tok.json"
    tok.write_text(toklib.train_bpe(sample[0], 300).to_json())
    return root, sample[0] + sample[1], tok


def _decoded(out) -> list[str]:
    index = D.read_index(out)
    tok = D.shard_tokenizer(out)
    flat = np.concatenate([np.memmap(out / s["file"], dtype=index["dtype"], mode="r") for s in index["shards"]])
    pieces = np.split(flat.astype(np.int64), np.flatnonzero(flat == tok.eot_id) + 1)[:-1]
    return [tok.decode(p[:-1]) for p in pieces]


def test_a_subset_of_a_hub_laid_out_folder(hub_folder, tmp_path):
    root, docs, tok = hub_folder
    out = tmp_path / "shards"
    assert (
        cli_main(
            [
                "prepare",
                str(root),
                "--subset",
                "sample-10BT",
                "--split",
                "train",
                "--text-field",
                "text",
                "--tokenizer",
                str(tok),
                "--shard-tokens",
                "500",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert _decoded(out) == docs  # only that subset, in file order
    index = D.read_index(out)
    assert index["config"] == "sample-10BT" and index["documents"] == len(docs) and len(index["shards"]) > 2


def test_max_tokens_stops_at_the_document_that_reaches_it(hub_folder, tmp_path):
    root, docs, tok = hub_folder
    out = shards.prepare(
        [str(root)],
        tmp_path / "capped",
        tokenizer=str(tok),
        config="sample-10BT",
        max_tokens=1000,
        shard_tokens=300,
        progress=False,
    )
    index = D.read_index(out)
    got = _decoded(out)
    last = len(toklib.from_file(tok).encode(got[-1])) + 1
    assert got == docs[: len(got)] and index["tokens"] >= 1000 > index["tokens"] - last


def test_an_interrupted_preparation_resumes_after_its_last_shard(hub_folder, tmp_path, monkeypatch):
    root, docs, tok = hub_folder
    files = [str(root / "sample" / "10BT" / "*.parquet")]  # a glob: both files, sorted
    fresh = shards.prepare(files, tmp_path / "fresh", tokenizer=str(tok), shard_tokens=400, progress=False)
    real = shards._documents

    def dies_after(n):
        count = [0]

        def documents(*args, **kwargs):
            for doc in real(*args, **kwargs):
                if count[0] == n:
                    raise KeyboardInterrupt
                count[0] += 1
                yield doc

        return documents

    out = tmp_path / "resumed"
    monkeypatch.setattr(shards, "_documents", dies_after(90))  # dies in the second file, the first one's shards written
    with pytest.raises(KeyboardInterrupt):
        shards.prepare(files, out, tokenizer=str(tok), shard_tokens=400, progress=False)
    state = json.loads((out / shards.STATE_FILE).read_text())
    assert not state["done"] and state["shards"] and not (out / "index.json").exists()
    kept = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in state["shards"]}
    monkeypatch.setattr(shards, "_documents", real)
    shards.prepare(files, out, tokenizer=str(tok), shard_tokens=400, progress=False)
    assert {f: (out / f).stat().st_mtime_ns for f in kept} == kept  # finished shards were not rewritten
    assert _decoded(out) == _decoded(fresh) == docs
    for name in ("tokens", "documents", "shards"):
        assert D.read_index(out)[name] == D.read_index(fresh)[name]
    with pytest.raises(UsageError, match="other inputs or settings"):
        shards.prepare(files, out, tokenizer=str(tok), shard_tokens=999, progress=False)


def test_a_pattern_that_matches_nothing_is_one_sentence(tmp_path):
    with pytest.raises(UsageError, match=r"The pattern '.*\*\.parquet' matches no file\."):
        shards.prepare([str(tmp_path / "*.parquet")], tmp_path / "out", progress=False)
