"""The lm-eval adapter against brute force: direct forward passes of a tiny float64 model with the real GPT-2
tokenizer, on random passages of the Shakespeare corpus."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from harness import build_model, model_preset
from harness.errors import UsageError
from harness.evaluation.lm_adapter import DepthmemLM

CONTEXT = 24  # the model's max_seq_len: small, so truncation and windows are easy to reach


@pytest.fixture(scope="module")
def tokenizer():
    from harness.data.tokenizer import gpt2

    return gpt2()


@pytest.fixture(scope="module")
def corpus() -> str:
    from harness.data.corpus import shakespeare_documents

    return dict(shakespeare_documents())["hamlet"]


@pytest.fixture
def model(rng_seed):
    # A wider init than training's keeps the random model's distributions far from uniform.
    m = build_model(model_preset("tiny", vocab_size=50257, max_seq_len=CONTEXT, init_std=0.2), "preln")
    return m.double().eval()


@pytest.fixture
def rng(rng_seed) -> random.Random:
    return random.Random(rng_seed)


def passage(corpus: str, rng: random.Random, n_words: int) -> str:
    words = corpus.split()
    start = rng.randrange(len(words) - n_words)
    return " ".join(words[start : start + n_words])


def log_probs_of(model, ids: list[int]) -> torch.Tensor:
    """Brute force: one unbatched forward pass, float64 log-softmax, (t, vocab) for inputs ``ids``."""
    with torch.no_grad():
        return F.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


def score(model, inputs: list[int], targets: list[int]) -> tuple[float, bool]:
    """Summed log-prob of ``targets``, the last len(targets) tokens predicted from ``inputs``, and greedy match."""
    lp = log_probs_of(model, inputs)[-len(targets) :]
    t = torch.tensor(targets)
    return float(lp.gather(1, t[:, None]).sum()), bool((lp.argmax(-1) == t).all())


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_tokenization_boundaries_follow_hflm(model, tokenizer):
    """A continuation keeps its leading space, a context's trailing space moves to it, empty context means eot."""
    lm = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=2, device="cpu")
    assert tokenizer.encode("Hello world") == [15496, 995]
    got = lm.loglikelihood(requests("loglikelihood", [("Hello", " world"), ("Hello ", "world"), ("", " world")]))
    assert got[0][0] == pytest.approx(score(model, [15496], [995])[0], abs=1e-10)
    assert got[1][0] == pytest.approx(got[0][0], abs=1e-10)
    assert got[2][0] == pytest.approx(score(model, [tokenizer.eot_id], [995])[0], abs=1e-10)


@pytest.mark.slow
def test_loglikelihood_equals_brute_force(model, tokenizer, corpus, rng):
    """Summed log-probs and greedy flags equal direct forward passes, with and without left truncation."""
    lm = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=3, device="cpu")
    pairs = [(passage(corpus, rng, rng.randint(2, 8)), " " + passage(corpus, rng, rng.randint(1, 4))) for _ in range(5)]
    pairs += [(passage(corpus, rng, 40), " " + passage(corpus, rng, 3))]  # longer than the context
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (log_prob, greedy) in zip(pairs, got):
        ctx = tokenizer.encode(context)
        cont = tokenizer.encode(context + continuation)[len(ctx) :]
        tokens = ctx + cont
        # Everything but the last token is input; only the last CONTEXT inputs fit.
        want = score(model, tokens[:-1][-CONTEXT:], cont)
        assert log_prob == pytest.approx(want[0], rel=1e-9, abs=1e-9)
        assert greedy == want[1]
        if len(tokens) <= CONTEXT + 1:  # fits: identical to scoring the whole sequence
            full = log_probs_of(model, tokens[:-1])
            assert log_prob == pytest.approx(
                float(sum(full[len(ctx) - 1 + i, c] for i, c in enumerate(cont))), rel=1e-9, abs=1e-9
            )


def test_continuation_longer_than_context_is_scored_in_windows(model, tokenizer, corpus, rng):
    """Each piece of an over-long continuation is conditioned on the CONTEXT tokens just before it."""
    lm = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=2, device="cpu")
    context, continuation = passage(corpus, rng, 5), " " + passage(corpus, rng, 45)
    ctx = tokenizer.encode(context)
    cont = tokenizer.encode(context + continuation)[len(ctx) :]
    assert len(cont) > CONTEXT
    tokens, want = ctx + cont, 0.0
    end = len(tokens)
    while end > len(ctx):
        cut = max(len(ctx), end - CONTEXT)
        want += score(model, tokens[: end - 1][-CONTEXT:], tokens[cut:end])[0]
        end = cut
    ((got, _),) = lm.loglikelihood(requests("loglikelihood", [(context, continuation)]))
    assert got == pytest.approx(want, rel=1e-9)


def test_is_greedy_matches_argmax(model, tokenizer, corpus, rng):
    """The model's own argmax token is greedy; the runner-up is not."""
    lm = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=4, device="cpu")
    checked = 0
    for _ in range(40):
        context = passage(corpus, rng, 6)
        ctx = tokenizer.encode(context)
        lp = log_probs_of(model, ctx)[-1]
        ranked = lp.argsort(descending=True).tolist()
        best, second = tokenizer.decode([ranked[0]]), tokenizer.decode([ranked[1]])
        # Only tokens whose text re-encodes to themselves after this context make a clean test, and only a clear
        # winner: a near-tie among 50257 tokens may be ordered the other way by the rounding of a batched pass.
        if tokenizer.encode(context + best) != ctx + [ranked[0]] or tokenizer.encode(context + second) != ctx + [
            ranked[1]
        ]:
            continue
        if lp[ranked[0]] - lp[ranked[1]] < 1e-4:
            continue
        (_, g1), (_, g2) = lm.loglikelihood(requests("loglikelihood", [(context, best), (context, second)]))
        top = [(t, float(lp[t])) for t in ranked[:3]]
        assert g1 and not g2, f"context {context!r}: greedy {g1}, {g2} for the top tokens {top}"
        checked += 1
        if checked == 3:
            break
    assert checked > 0, "no context gave a re-encodable greedy token"


@pytest.mark.slow
def test_batch_size_and_request_order_change_nothing(model, tokenizer, corpus, rng):
    """Same answers for batch sizes 1 and 5 and for shuffled requests, including shared-context choices."""
    shared = passage(corpus, rng, 6)
    pairs = [(shared, " " + w) for w in ("the", "a", "my", "lord")]  # one-token choices: grouped by context
    pairs += [
        (passage(corpus, rng, rng.randint(1, 30)), " " + passage(corpus, rng, rng.randint(1, 5))) for _ in range(8)
    ]
    one = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=1, device="cpu")
    five = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=5, device="cpu")
    base = one.loglikelihood(requests("loglikelihood", pairs))
    order = list(range(len(pairs)))
    rng.shuffle(order)
    shuffled = five.loglikelihood(requests("loglikelihood", [pairs[i] for i in order]))
    for position, i in enumerate(order):
        assert shuffled[position][0] == pytest.approx(base[i][0], rel=1e-10, abs=1e-10)
        assert shuffled[position][1] == base[i][1]
    texts = [passage(corpus, rng, rng.randint(3, 60)) for _ in range(4)]
    a = one.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    b = five.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in reversed(texts)]))
    assert a == pytest.approx(b[::-1], rel=1e-10)


def test_rolling_equals_full_sequence_when_it_fits(model, tokenizer, corpus, rng):
    lm = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=2, device="cpu")
    text = passage(corpus, rng, 8)
    tokens = tokenizer.encode(text)
    assert len(tokens) <= CONTEXT
    want = score(model, [tokenizer.eot_id] + tokens[:-1], tokens)[0]
    (got,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert isinstance(got, float)
    assert got == pytest.approx(want, rel=1e-10)


def test_rolling_sums_disjoint_windows_when_it_does_not_fit(model, tokenizer, corpus, rng):
    """Windows of CONTEXT predictions each; the last one keeps a full context and scores only the remainder."""
    lm = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=3, device="cpu")
    text = passage(corpus, rng, 70)
    tokens = tokenizer.encode(text)
    assert len(tokens) > 2 * CONTEXT
    want = score(model, [tokenizer.eot_id] + tokens[: CONTEXT - 1], tokens[:CONTEXT])[0]
    for start in range(CONTEXT, len(tokens), CONTEXT):
        end = min(start + CONTEXT, len(tokens))
        want += score(model, tokens[end - 1 - CONTEXT : end - 1], tokens[start:end])[0]
    (got,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert got == pytest.approx(want, rel=1e-10)


def greedy_tokens(model, ids: list[int], n: int, eot: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(log_probs_of(model, (ids + out)[-CONTEXT:])[-1].argmax())
        if token == eot:
            break
        out.append(token)
    return out


@pytest.mark.slow
def test_generate_until_is_greedy_and_stops(model, tokenizer, corpus, rng):
    """Greedy tokens up to max_gen_toks, cut at the first stop string."""
    lm = DepthmemLM(model=model, tokenizer=tokenizer, batch_size=2, device="cpu")
    contexts = [passage(corpus, rng, rng.randint(3, 30)) for _ in range(3)]
    expected = [tokenizer.decode(greedy_tokens(model, tokenizer.encode(c), 6, tokenizer.eot_id)) for c in contexts]
    got = lm.generate_until(requests("generate_until", [(c, {"until": [], "max_gen_toks": 6}) for c in contexts]))
    assert got == expected
    # A stop string taken from the middle of the first output cuts it there.
    stop = expected[0][len(expected[0]) // 2 :][:3]
    if stop.strip():
        (cut,) = lm.generate_until(requests("generate_until", [(contexts[0], {"until": [stop], "max_gen_toks": 6})]))
        assert cut == expected[0].split(stop)[0]


def test_bad_model_arguments_are_usage_errors(model, tokenizer):
    with pytest.raises(UsageError, match="batch_size"):
        DepthmemLM(model=model, tokenizer=tokenizer, batch_size=0)
    with pytest.raises(UsageError, match="allowed: checkpoint"):
        DepthmemLM(model=model, tokenizer=tokenizer, revision="main")
    # ``pretrained`` is another name for ``checkpoint`` (so lm-eval names its output folder after the run):
    # a Hugging Face hub name there is not a run.
    with pytest.raises(UsageError, match="neither a run directory nor a checkpoint"):
        DepthmemLM(model=model, tokenizer=tokenizer, pretrained="gpt2")
    with pytest.raises(UsageError, match="checkpoint=PATH"):
        DepthmemLM.create_from_arg_string("batch_size=4")
