"""The ``depthmem`` model for lm-eval: any checkpoint of any variant, scored by lm-eval's own evaluator.

``DepthmemLM`` follows lm-eval's ``TemplateLM`` contract and reproduces Hugging Face ``HFLM``'s choices, so its
numbers are comparable with published ones: a context's trailing spaces move to the continuation and the pair is
tokenized as one string then split at the context's length; an empty context is replaced by the end-of-text
token; inputs longer than the model's context are truncated from the left; perplexity uses lm-eval's rolling
windows; generation is greedy. Requests are sorted by length and batched with lm-eval's ``Collator`` (right
padding is harmless because every variant is causal) and answers come back in request order.

Build it from a checkpoint (``DepthmemLM(checkpoint="runs/x")``, or ``--model depthmem --model_args
checkpoint=PATH`` (or ``pretrained=PATH``, after which lm-eval names its output folder) on lm-eval's command line
once this module is imported) or from a model and tokenizer already
in memory (``DepthmemLM(model=decoder, tokenizer=tok)``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from harness.errors import UsageError
from harness.model.checkpoint import load_model

log = logging.getLogger(__name__)

MODEL_ARGS = ("checkpoint", "pretrained", "batch_size", "device", "max_length", "max_gen_toks")
# lm-eval's evaluator passes these to every model; they mean nothing here (no automatic batch sizing).
_IGNORED_ARGS = ("max_batch_size", "trust_remote_code")


def _positive_int(value: Any, name: str) -> int:
    try:
        number = int(value)
        ok = number >= 1 and float(value) == number
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UsageError(f"The depthmem model's {name} must be a positive integer, got {value!r}.")
    return number


def _resolve_device(device: str | None) -> str:
    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's command line asks for cuda:0 unless told otherwise, even on a CPU-only node.
        log.warning("CUDA is not available; evaluating on the CPU instead of %s", device)
        return "cpu"
    return str(device)


@register_model("depthmem")
class DepthmemLM(TemplateLM):
    """A depthmem ``Decoder`` and its tokenizer, answering lm-eval's three request types."""

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        model=None,
        tokenizer=None,
        batch_size: int | str = 16,
        device: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int | str = 256,
        pretrained: str | None = None,
        **extra: Any,
    ):
        super().__init__()
        # ``pretrained=`` is what lm-eval names its output folder after, as for Hugging Face models.
        if pretrained is not None and checkpoint is not None and str(pretrained) != str(checkpoint):
            raise UsageError(
                f"The depthmem model got checkpoint={checkpoint} and pretrained={pretrained}; give "
                "one of them (they mean the same)."
            )
        checkpoint = checkpoint if checkpoint is not None else pretrained
        unknown = sorted(set(extra) - set(_IGNORED_ARGS))
        if unknown:
            raise UsageError(f"Unknown depthmem model argument {unknown[0]!r}; allowed: {', '.join(MODEL_ARGS)}.")
        device = _resolve_device(device)
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.run_config = None  # the checkpoint's RunConfig; None for a model handed over in memory
        if checkpoint is not None:
            model, tokenizer, self.run_config = load_model(self.checkpoint, device=device)
        elif model is None or tokenizer is None:
            raise UsageError("The depthmem model needs checkpoint=PATH (a run directory or a .ckpt file).")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        context = int(model.cfg.max_seq_len)
        self._max_length = context if max_length is None else min(_positive_int(max_length, "max_length"), context)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DepthmemLM:
        """Build from lm-eval's ``key=value,...`` string; its own settings (batch size, device) fill the gaps."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> DepthmemLM:
        """Build from a dict of model arguments; an argument given there wins over lm-eval's global setting."""
        merged = {k: v for k, v in (additional_config or {}).items() if v is not None}
        merged.update(arg_dict)
        return cls(**merged)

    def get_model_info(self) -> dict:
        """What lm-eval records under ``config`` in its results: checkpoint, variant, size."""
        info = {
            "checkpoint": self.checkpoint,
            "params": sum(p.numel() for p in self.model.parameters()),
            "max_length": self.max_length,
            "device_used": str(self._device),
        }
        if self.run_config is not None:
            info.update(
                variant=self.run_config.variant, preset=self.run_config.model.preset, seed=self.run_config.train.seed
            )
        return info

    # -- what TemplateLM needs ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eot_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return f"depthmem-{getattr(self.tokenizer, 'kind', type(self.tokenizer).__name__)}-{self.tokenizer.vocab_size}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits (b, t, vocab) for token rows of different lengths, right-padded."""
        width = max(len(r) for r in rows)
        # Pad with a real token id; causality keeps padding from touching the positions that are read.
        batch = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            batch[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return self.model(batch.to(self._device))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Score ``(key, context_tokens, continuation_tokens)`` triples: summed log-prob and greedy match.

        A continuation longer than the model's context is scored in pieces from its end, each piece conditioned
        on the ``max_length`` tokens before it, so every token still sees as much context as the model allows.
        """
        pieces, owners = [], []
        for index, (key, context_enc, continuation_enc) in enumerate(requests):
            if not context_enc:
                raise ValueError("a loglikelihood request needs a non-empty context (lm-eval supplies end-of-text)")
            if len(continuation_enc) <= self.max_length:
                pieces.append((key, context_enc, continuation_enc))
                owners.append(index)
                continue
            tokens, start = context_enc + continuation_enc, len(context_enc)
            for end in range(len(tokens), start, -self.max_length):
                cut = max(start, end - self.max_length)
                pieces.append((None, tokens[:cut], tokens[cut:end]))
                owners.append(index)
        totals = [0.0] * len(requests)
        greedy = [True] * len(requests)  # an empty continuation is trivially the greedy one
        for owner, (log_prob, is_greedy) in zip(owners, self._score(pieces, disable_tqdm, greedy=True)):
            totals[owner] += log_prob
            greedy[owner] = greedy[owner] and is_greedy
        answers = list(zip(totals, greedy))
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def _score(self, pieces, disable_tqdm: bool, *, greedy: bool) -> list[tuple[float, bool]]:
        """Score pieces whose continuation fits the context, batched by length, in their given order.

        Without ``greedy`` the greedy check is skipped (reported False): perplexity never reads it.
        """

        def by_length(piece):
            tokens = piece[1] + piece[2]
            return -len(tokens), tuple(tokens)

        # Grouping by context + continuation[:-1] scores the choices of a multiple-choice question that differ
        # only in their last token with one forward pass, as HFLM does.
        order = Collator(pieces, sort_fn=by_length, group_by="contexts", group_fn=lambda p: p[1] + p[2][:-1])
        results = []
        bar = tqdm(total=len(pieces), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in order.get_batched(n=self.batch_size):
            # The last token is only a target; everything before the window's start is cut from the left.
            rows = [
                (context_enc + continuation_enc)[-(self.max_length + 1) :][:-1]
                for _, context_enc, continuation_enc in chunk
            ]
            logits = self._logits(rows)  # (b, t, vocab)
            for (key, context_enc, continuation_enc), row_logits, row in zip(chunk, logits, rows):
                for _, continuation_i, _ in order.get_cache(
                    req_str=key, cxt_toks=context_enc, cont_toks=continuation_enc, logits=row_logits
                ):
                    # Pieces sharing a group end at the same position, so their scored rows are the trailing ones.
                    scored = row_logits[len(row) - len(continuation_i) : len(row)]  # (n_cont, vocab)
                    log_probs = F.log_softmax(scored.to(torch.promote_types(scored.dtype, torch.float32)), dim=-1)
                    target = torch.tensor(continuation_i, dtype=torch.long, device=scored.device)
                    is_greedy = greedy and bool((scored.argmax(dim=-1) == target).all())
                    results.append((float(log_probs.gather(1, target[:, None]).sum()), is_greedy))
                    bar.update(1)
        bar.close()
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, scored in lm-eval's disjoint rolling windows; one float per text."""
        windows, owners = [], []
        for index, req in enumerate(tqdm(requests, disable=disable_tqdm, desc="Windowing texts")):
            (text,) = req.args
            for context_enc, continuation_enc in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context_enc, continuation_enc))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._score(windows, disable_tqdm, greedy=False)):
            totals[owner] += log_prob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations that stop at the first stop string, the end-of-text token or ``max_gen_toks``."""
        order = Collator(
            [req.args for req in requests],
            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
            group_by="gen_kwargs",
            group_fn=lambda a: a[1],
        )
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for chunk in order.get_batched(n=self.batch_size):
            contexts, gen_kwargs = zip(*chunk)
            kwargs = dict(gen_kwargs[0])  # one Collator group shares its generation arguments
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = _positive_int(kwargs.pop("max_gen_toks", self.max_gen_toks), "max_gen_toks")
            if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0) or 0.0) > 0:
                log.warning("depthmem generates greedily; ignoring do_sample=%s", kwargs["do_sample"])
            for context, text in zip(contexts, self._greedy(list(contexts), until, max_new)):
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs[0]), text)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def _greedy(self, contexts: list[str], until: list[str], max_new: int) -> list[str]:
        """Decode a batch greedily, each row over its own last ``max_length`` tokens, and cut at stop strings."""
        prompts = [self.tok_encode(c) or [self.prefix_token_id] for c in contexts]
        generated: list[list[int]] = [[] for _ in contexts]
        active = list(range(len(contexts)))
        for _ in range(max_new):
            if not active:
                break
            rows = [(prompts[i] + generated[i])[-self.max_length :] for i in active]
            logits = self._logits(rows)  # (b, t, vocab)
            still = []
            for row, i in enumerate(active):
                token = int(logits[row, len(rows[row]) - 1].argmax())
                if token == self.eot_token_id:
                    continue
                generated[i].append(token)
                if not any(stop in self.tok_decode(generated[i]) for stop in until):
                    still.append(i)
            active = still
        outputs = []
        for tokens in generated:
            text = self.tok_decode(tokens)
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs
