"""Hostile-run defects of the logit controls (issue 39): banned sequences (bad_words_ids) must not
make every step cost in proportion to their number."""
from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specrt
from specrt import SamplingParams
from specrt.sampling.controls import control_state
from specrt.sampling.transform import apply_controls, batch_controls

V = 12   # a small vocabulary: random histories often end with a banned prefix


def _request(words, prompt, output):
    return SimpleNamespace(params=SamplingParams(bad_words_ids=words, max_tokens=64), prompt_token_ids=list(prompt),
                           output_token_ids=list(output), token_ids=list(prompt) + list(output), controls_state=None)


def _naive_banned(words, history) -> set[int]:
    """transformers' NoBadWordsLogitsProcessor rule: a sequence's last token is banned when the
    history ends with its other tokens (a one-token sequence: always)."""
    return {w[-1] for w in words
            if len(w) == 1 or (len(history) >= len(w) - 1 and list(history[len(history) - len(w) + 1:]) == w[:-1])}


def _controlled(batch, drafts: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """The -inf mask apply_controls leaves on zero logits at rows (request b, after drafts[b, :i])."""
    logits = torch.zeros(len(rows), V)
    ctl = batch_controls(batch, torch.device("cpu"))
    if ctl is not None:            # None: no request has a control
        apply_controls(logits, ctl, [b for b, _ in rows], [i for _, i in rows], drafts)
    return torch.isinf(logits)


def _random_case(rng: random.Random):
    B, K = rng.randint(1, 4), rng.randint(0, 4)
    batch, words_of = [], []
    for _ in range(B):
        words = [[rng.randrange(V) for _ in range(rng.choice([1, 2, 2, 3, 3, 4, 5]))]
                 for _ in range(rng.randint(0, 12))]
        words_of.append(words)
        batch.append(_request(words or None, [rng.randrange(V) for _ in range(rng.randint(1, 6))],
                              [rng.randrange(V) for _ in range(rng.randint(0, 5))]))
    drafts = torch.tensor([[rng.randrange(V) for _ in range(K)] for _ in range(B)], dtype=torch.int32).view(B, K)
    rows = [(b, i) for b in range(B) for i in range(K + 1) if rng.random() < 0.8] or [(0, 0)]
    return batch, words_of, drafts, rows


def test_banned_sequences_match_the_naive_rule_on_random_cases():
    rng = random.Random(0)
    for _ in range(400):
        batch, words_of, drafts, rows = _random_case(rng)
        got = _controlled(batch, drafts, rows)
        for j, (b, i) in enumerate(rows):
            r = batch[b]
            history = r.prompt_token_ids + r.output_token_ids + drafts[b, :i].tolist()
            want = _naive_banned(words_of[b], history)
            assert set(torch.nonzero(got[j]).flatten().tolist()) == want, (words_of[b], history)


def _traced_lines(fn) -> int:
    """Python lines executed by fn() (every frame it calls): a deterministic operation count."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def glob(frame, event, arg):
        return local

    sys.settrace(glob)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _step_cost(num_words: int) -> int:
    """Operations of one step's controls (build + a verify's rows after 0..4 drafts) for a batch of
    4 requests, one of them with ``num_words`` banned sequences (made once, as at admission)."""
    rng = random.Random(num_words)
    vocab = 4096
    words = [[rng.randrange(vocab) for _ in range(rng.randint(2, 6))] for _ in range(num_words)]
    words[0] = [5, 6, 7]              # one that matches the history below: its ban is found
    batch = [_request(words, [1, 2, 3, 4, 5], [6])] + [_request([[9, 9]], [1, 2], [3]) for _ in range(3)]
    for r in batch:
        control_state(r)                   # the request's state is built once, at its first step
    drafts = torch.tensor([[7, 8, 9, 10]] * 4, dtype=torch.int32)
    rows = [(b, i) for b in range(4) for i in range(5)]
    logits = torch.zeros(len(rows), vocab)

    def step():
        ctl = batch_controls(batch, torch.device("cpu"))
        apply_controls(logits, ctl, [b for b, _ in rows], [i for _, i in rows], drafts)

    cost = _traced_lines(step)
    assert torch.isinf(logits[0, 7])  # the matching sequence [5, 6, 7] banned 7 after ... 5, 6
    return cost


def test_per_step_cost_does_not_grow_with_the_number_of_banned_sequences():
    small, large = _step_cost(100), _step_cost(10_000)
    assert large <= 2 * small + 100, (small, large)


def test_many_decoy_sequences_change_nothing_but_the_matching_ban():
    """End to end: 10,000 never-matching sequences around one that matches give the same output
    as the matching one alone, and the banned sequence never appears."""
    llm = specrt.LLM(target="builtin", draft="builtin", seed=0)
    prompt = "def add(a, b):"
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = llm.generate([prompt], base)[0].token_ids
    ban = free[3:5]                                   # a pair the free run emits
    one = llm.generate([prompt], SamplingParams(**{**base.__dict__, "bad_words_ids": [ban]}))[0].token_ids
    ids = set(llm.tokenizer.encode(prompt)) | set(free) | set(one)
    spare = [t for t in range(10, 4000) if t not in ids]
    rng = random.Random(1)
    decoys = [[rng.choice(spare) for _ in range(rng.randint(2, 5))] for _ in range(10_000)]
    many = llm.generate([prompt], SamplingParams(**{**base.__dict__, "bad_words_ids": decoys + [ban]}))[0].token_ids
    assert many == one
    assert all(one[i:i + 2] != ban for i in range(len(one) - 1))
