"""Prompt lookup in front of a draft model (draft="MODEL+ngram", specrt.drafters.lookup).

- greedy: output == autoregressive decoding, with the lookup really drafting some steps and the
  model the others (layer and reduced-vocabulary drafts, K 1..4);
- sampling: rows drafted by the lookup (one-hot q) and by the model (its q) in one batch keep
  rejection sampling exact (chi-square of the first two tokens against the target's exact
  conditionals); a lookup that reports another q than the one-hot it drew from (uniform) fails
  the same test (forgetting q altogether, all zeros, only costs speed: q(x) = 0 is rejected and
  resampled from p, which stays exact);
- bad draft strings are refused with an error naming them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import VOCAB, exact_tables, make_pair, tokens  # noqa: E402
from _stats import P_FAIL, P_PASS, chisquare_conditional  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.drafters import lookup as lookup_mod  # noqa: E402
from specrt.drafters import model as model_mod  # noqa: E402

# prompts that repeat themselves (the lookup matches) and prompts that do not (the model drafts)
PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20, 21] * 5, [30, 31], [40, 41, 42, 43, 40, 41, 42], [70]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lookup")
    tdir, ddir = make_pair(root)
    from test_reduced_draft import save_reduced_draft
    return tdir, ddir, save_reduced_draft(tdir, root / "reduced")


@pytest.fixture(scope="module")
def looped(pair):
    """A prompt that ends in the target's own greedy text, which repeats itself: most tokens sampled
    after it continue an earlier n-gram, and the target often agrees with that continuation."""
    ar = specrt.LLM(target=str(pair[0]), draft=None, seed=0)
    return [40, 41] + ar.generate([[40, 41]], SamplingParams(temperature=0.0, max_tokens=30,
                                                            ignore_eos=True))[0].token_ids


class _Counter:
    """Counts the rows the lookup drafted and the rows the model drafted (the lookup drafts in
    batches of any size here: lookup and model rows meet in one step)."""

    def __init__(self, monkeypatch):
        monkeypatch.setattr(lookup_mod, "LOOKUP_MAX_BATCH", 1 << 20)
        self.lookup = self.model = 0
        propose = lookup_mod.PromptLookup.propose
        counter = self

        def counted(self_, batch, ks, skip):
            found = propose(self_, batch, ks, skip)
            counter.lookup += len(found)
            counter.model += sum(1 for b in range(len(batch)) if ks[b] > 0 and not skip[b] and b not in found)
            return found
        monkeypatch.setattr(lookup_mod.PromptLookup, "propose", counted)


@pytest.mark.parametrize("draft,k,overlap", [("model", 1, False), ("model", 3, False), ("model", 3, True),
                                             ("reduced", 2, False), ("reduced", 4, True)])
def test_greedy_equals_autoregressive(pair, monkeypatch, draft, k, overlap):
    tdir, ddir, rdir = pair
    ar = tokens(specrt.LLM(target=str(tdir), draft=None, seed=0).generate(PROMPTS, GREEDY))
    counter = _Counter(monkeypatch)
    folder = {"model": ddir, "reduced": rdir}[draft]
    llm = specrt.LLM(target=str(tdir), draft=f"{folder}+ngram:1", seed=0, spec=SpecConfig(max_draft_length=k, overlap=overlap, tree="chain"))
    assert llm.engine.draft_kind.endswith("+ngram")
    drafter, marked = llm.engine.drafter, []
    propose = drafter.propose

    def recorded(*a, **kw):
        p = propose(*a, **kw)
        marked.append(len(p.lookup_rows))
        return p
    drafter.propose = recorded
    assert tokens(llm.generate(PROMPTS, GREEDY)) == ar
    assert counter.lookup > 0 and counter.model > 0          # both kinds of rows really drafted
    assert sum(marked) == counter.lookup                     # the proposal names its lookup rows
    assert tokens(llm.generate(PROMPTS[::-1], GREEDY)) == ar[::-1]


def _joint(llm, n: int, prompt: list[int]) -> np.ndarray:
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True, seed=1000 + i)
              for i in range(n)]
    got = np.array([o.token_ids[:2] for o in llm.generate([prompt] * n, params)])
    joint = np.zeros((VOCAB, VOCAB))
    np.add.at(joint, (got[:, 0], got[:, 1]), 1)
    return joint


@pytest.mark.slow
def test_rejection_sampling_with_lookup_rows_is_exact(pair, looped, monkeypatch):
    tdir, ddir, _ = pair
    _, second = exact_tables(tdir, looped)
    spec = SpecConfig(max_draft_length=2, max_batch_size=256, tree="chain")
    counter = _Counter(monkeypatch)
    llm = specrt.LLM(target=str(tdir), draft=f"{ddir}+ngram:1", seed=0, spec=spec)
    joint = _joint(llm, 4000, looped)
    assert counter.lookup > 300 and counter.model > 300     # one-hot and model rows, mixed in batches
    assert 0.15 < llm.stats()["total"]["first_token_acceptance_rate"] < 0.95   # accepts and resamples
    assert chisquare_conditional(joint, second)[1] > P_PASS

    def uniform_q(found, draft_ids, draft_probs):          # claims the lookup drew from a uniform q
        lookup_mod.fill_lookup_rows(found, draft_ids, draft_probs)
        for b, prop in found.items():
            draft_probs[b, :len(prop)] = 1.0 / VOCAB
    monkeypatch.setattr(model_mod, "fill_lookup_rows", uniform_q)
    bad = specrt.LLM(target=str(tdir), draft=f"{ddir}+ngram:1", seed=0, spec=spec)
    assert chisquare_conditional(_joint(bad, 4000, looped), second)[1] < P_FAIL


def test_bad_lookup_strings_name_the_problem(pair):
    tdir, ddir, _ = pair
    with pytest.raises(ValueError, match="ngram"):
        specrt.LLM(target=str(tdir), draft=f"{ddir}+bigram", seed=0)
    with pytest.raises(ValueError, match="integers"):
        specrt.LLM(target=str(tdir), draft=f"{ddir}+ngram:x", seed=0)
    with pytest.raises(ValueError, match="in front of a draft model"):
        specrt.LLM(target=str(tdir), draft="ngram+ngram", seed=0)
    with pytest.raises(ValueError, match="min_n"):
        specrt.LLM(target=str(tdir), draft=f"{ddir}+ngram:3:2", seed=0)


def test_overlap_does_not_pre_draft_a_lookup_row(pair):
    """A lookup row's draft KV did not advance this step, so the overlap (CUDA) must not pre-draft
    it from a KV that lacks its drafts; the model rows still get their slots."""
    from types import SimpleNamespace

    tdir, ddir, _ = pair
    drafter = specrt.LLM(target=str(tdir), draft=f"{ddir}+ngram:1", seed=0).engine.drafter

    class KV:
        def num_tokens(self, rid):
            return 10

        def append_slots(self, rid, n):
            return True

    drafter.kv = KV()
    batch = [SimpleNamespace(request_id=str(i), context_len=8) for i in range(3)]
    proposal = SimpleNamespace(num_draft_tokens=[2, 2, 2], lookup_rows=frozenset({1}))
    assert drafter.reserve_pre_draft(batch, proposal, [3, 3, 3]) == [3, 0, 3]
