"""Every sampling control is validated where it is given (issue 20): SamplingParams raises a
ValueError naming the field; token ids outside the vocabulary are refused by the engine before
anything is queued; the per-request penalty table is what apply_penalties expects."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import VOCAB, make_pair  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams  # noqa: E402
from specrt.sampling.controls import ControlState  # noqa: E402


@pytest.mark.parametrize("kw, match", [
    (dict(min_p=1.5), r"min_p must be a finite number in \[0, 1\]"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(min_p="0.1"), "min_p"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number in \[0.01, 100\]"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a finite number in \[-2, 2\]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias must be a dict"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must hold token ids"),
    (dict(logit_bias={"5": 1.0}), "logit_bias must hold token ids"),
    (dict(logit_bias={5: 101.0}), r"logit_bias\[5\] must be a finite number in \[-100, 100\]"),
    (dict(logit_bias={5: float("-inf")}), r"logit_bias\[5\]"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids must hold token ids"),
    (dict(allowed_token_ids=[1.0]), "allowed_token_ids must hold token ids"),
    (dict(bad_words_ids=[[]]), "bad_words_ids must hold non-empty lists"),
    (dict(bad_words_ids=[5]), "bad_words_ids must hold non-empty lists"),
    (dict(bad_words_ids=[[1] * 65]), "at most 64 token ids"),
    (dict(bad_words_ids=[[1, "x"]]), "bad_words_ids must hold token ids"),
    (dict(allowed_token_ids=[4, 5], bad_words_ids=[[4], [5], [6, 4]]), "bans every token of allowed_token_ids"),
    (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs"),
])
def test_bad_values_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_values_are_normalised():
    p = SamplingParams(min_p=0, repetition_penalty=2, logit_bias={3: 1}, allowed_token_ids=[9, 3, 9],
                       bad_words_ids=[(1, 2)])
    assert p.min_p == 0.0 and isinstance(p.repetition_penalty, float) and p.logit_bias == {3: 1.0}
    assert p.allowed_token_ids == [3, 9] and p.bad_words_ids == [[1, 2]]
    assert p.has_penalties and p.has_logit_controls
    plain = SamplingParams()
    assert not plain.has_penalties and not plain.has_logit_controls and plain.bad_words_ids == []
    assert SamplingParams(allowed_token_ids=[1]).has_logit_controls and not SamplingParams(min_p=0.5).has_penalties


@pytest.mark.parametrize("kw, field, bad", [(dict(logit_bias={VOCAB: 1.0}), "logit_bias", VOCAB),
                                            (dict(allowed_token_ids=[1, VOCAB + 5]), "allowed_token_ids", VOCAB + 5),
                                            (dict(bad_words_ids=[[3, VOCAB]]), "bad_words_ids", VOCAB)])
def test_token_ids_outside_the_vocabulary_are_refused_before_queuing(tmp_path, kw, field, bad):
    tdir, _ = make_pair(tmp_path)
    llm = specrt.LLM(target=str(tdir), seed=0)
    with pytest.raises(ValueError, match=f"request 1: {field}: token id {bad} is out of range"):
        llm.generate([[5, 6], [7]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, **kw)])
    assert not llm.engine.has_unfinished()


def test_penalty_entries_follow_the_history():
    """Prompt tokens only for repetition_penalty, generated tokens with their counts, the bias keys;
    caught up lazily as the output grows, and rebuilt only when it does."""
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={40: -3.0, 7: 1.0})
    s = ControlState(p, [7, 8, 8, 9])
    e = s.entries([])
    assert e.token.tolist() == [7, 8, 9, 40] and e.count.tolist() == [0, 0, 0, 0]
    assert e.in_prompt.tolist() == [True, True, True, False] and e.bias.tolist() == [1.0, 0.0, 0.0, -3.0]
    out = [9, 12, 9]
    e = s.entries(out)
    assert e.token.tolist() == [7, 8, 9, 12, 40] and e.count.tolist() == [0, 0, 2, 1, 0]
    assert s.entries(out) is e                                         # cached until the output grows
    assert s.entries(out + [40]).count.tolist() == [0, 0, 2, 1, 1]
    no_rep = ControlState(SamplingParams(presence_penalty=1.0), [7, 8]).entries([3, 3])
    assert no_rep.token.tolist() == [3] and no_rep.count.tolist() == [2] and not no_rep.in_prompt.any()
    assert e.token.dtype == np.int32 and e.count.dtype == np.int32 and e.bias.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(e.token).long(), torch.tensor([7, 8, 9, 12, 40]))
