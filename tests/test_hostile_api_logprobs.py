"""Hostile-run defects of prompt log-probabilities (issue 39): an 8k-token prompt with
prompt_logprobs must never hold its [P, V] logits (or their log-softmax) in memory at once."""
from __future__ import annotations

import pytest
import torch

import specrt
import specrt.sampling.logprobs
from specrt import SamplingParams

PROMPT = [5 + (i * 7) % 4000 for i in range(300)]
CHUNK = 16


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return specrt.LLM(target="builtin", draft="builtin", seed=0)


def _scored(llm, n: int = 5):
    return llm.generate([PROMPT, PROMPT[:40]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                               prompt_logprobs=n))


def test_prompt_logprobs_never_hold_every_rows_logits(llm, monkeypatch):
    """With the chunk size patched to 16 rows, no [rows, V] logits or log-probabilities block of a
    step scoring two prompts (300 + 40 rows) has more rows than a chunk (or the verified rows)."""
    V = llm.engine.vocab_size
    want = _scored(llm)                                   # the default chunk size
    seen = {"forward": [], "row_logprobs": []}
    target = llm.engine.target
    forward = target.forward

    def spy_forward(*a, **k):
        logits, hidden = forward(*a, **k)
        seen["forward"].append(logits.shape[0])
        return logits, hidden

    row_logprobs = specrt.sampling.logprobs.row_logprobs

    def spy_row_logprobs(logp, tokens, top_n):
        assert logp.shape[1] == V
        seen["row_logprobs"].append(logp.shape[0])
        return row_logprobs(logp, tokens, top_n)

    monkeypatch.setattr(specrt.sampling.logprobs, "PROMPT_LOGPROB_ROWS", CHUNK, raising=False)
    monkeypatch.setattr(target, "forward", spy_forward)
    monkeypatch.setattr(specrt.sampling.logprobs, "row_logprobs", spy_row_logprobs)
    got = _scored(llm)
    monkeypatch.undo()
    verified_rows = 2 * (llm.engine.spec.max_draft_length + 1)   # a step's verified rows, at most
    assert max(seen["forward"]) <= verified_rows, seen["forward"]
    assert max(seen["row_logprobs"]) <= CHUNK, seen["row_logprobs"]
    assert sum(seen["row_logprobs"]) >= 299 + 39          # every prompt row was scored
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) and g.prompt_logprobs[0] is None
        for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def test_prompt_logprobs_match_a_full_log_softmax(llm):
    """The chunked scores equal the log-softmax of the whole prompt's logits (one plain forward),
    for each row's own N (0 and 3 in one batch)."""
    from specrt.step.distributed import prefill_logits

    outs = llm.generate([PROMPT, PROMPT[:40]], [
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)])
    for o, prompt, n in zip(outs, [PROMPT, PROMPT[:40]], [3, 0]):
        ref = torch.log_softmax(prefill_logits(llm.engine.target, prompt).float(), -1)   # [P, V]
        for i, rec in enumerate(o.prompt_logprobs[1:]):
            assert rec.token_id == prompt[i + 1]
            assert abs(rec.logprob - float(ref[i, prompt[i + 1]])) < 2e-2
            assert len(rec.top) == n
            if n:
                assert abs(rec.top[0][1] - float(ref[i].max())) < 2e-2
