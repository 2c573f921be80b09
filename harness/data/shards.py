"""``depthmem prepare``: tokenizing text (local or hub Parquet, JSON lines, plain text) into a shard folder.

A shard folder holds flat uint16 or uint32 token files and an ``index.json`` that ``harness.data.corpus`` reads.
A preparation records its finished shards in ``prepare_state.json`` as it goes, so an interrupted one resumes
after its last finished shard instead of starting over.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from harness.config import model_preset
from harness.data import tokenizer as toklib
from harness.errors import UsageError
from harness.io import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    read_json,
    remove_stale_temps,
    writable_dir,
)

INDEX_FORMAT = "depthmem-shards/1"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


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


def _checked_inputs(inputs: list[str], shard_tokens: int, max_tokens: int | None) -> list[str]:
    """The inputs with folders and patterns expanded, once the limits are positive and every local file has text."""
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
    return inputs


def _check_fits_preset(tokenizer: str, bpe_size: int | None, preset: str) -> None:
    """Refuse, before any work, a tokenizer larger than the vocabulary of the model this corpus is for."""
    vocab = model_preset(preset).vocab_size
    size = bpe_size or (toklib.GPT2_VOCAB_SIZE if tokenizer == "gpt2" else toklib.from_file(tokenizer).vocab_size)
    if size > vocab:
        raise UsageError(
            f"The tokenizer has {size} tokens but the preset {preset!r} has model.vocab_size "
            f"{vocab}: train on this corpus with model.vocab_size={size}, or prepare it with "
            f"--tokenizer bpe:{vocab}."
        )


def _shard_tokenizer(tokenizer: str, bpe_size: int | None, inputs: list[str], out: Path, read: tuple):
    """The tokenizer and how the index names it; one not built in is saved as ``tokenizer.json`` in ``out``."""
    if tokenizer == "gpt2":
        return toklib.gpt2(), "gpt2"
    if bpe_size:
        # A byte-level BPE of the asked size, trained on these very documents, then used to encode them.
        tok = toklib.train_bpe((t for path in inputs for t in _documents(path, *read)), bpe_size)
    else:
        tok = toklib.from_file(tokenizer)
    atomic_write_text(out / "tokenizer.json", tok.to_json())
    return tok, "tokenizer.json"


def _write_shards(inputs, out: Path, tok, dtype, state: dict, read: tuple, shard_tokens, max_tokens, progress) -> None:
    """Tokenize the documents not yet in a finished shard into further shards, recording each in the state file."""
    from tqdm.auto import tqdm

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
            docs = _documents(path, *read)
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
    read = (text_field, split, config)
    inputs = _checked_inputs(inputs, shard_tokens, max_tokens)
    bpe_size = _bpe_size(tokenizer)
    if preset is not None:
        _check_fits_preset(tokenizer, bpe_size, preset)
    out = writable_dir(out, "shard folder")
    remove_stale_temps(out)
    tok, tok_ref = _shard_tokenizer(tokenizer, bpe_size, inputs, out, read)
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
    _write_shards(inputs, out, tok, dtype, state, read, shard_tokens, max_tokens, progress)
    shards = state["shards"]
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
