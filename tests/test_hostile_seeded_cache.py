"""Hostile-run defect 9 (issue 39): a seeded request's sampled output must not depend on what the
prefix cache held. A 17-token prompt is cold on its first run (the step prefills: no drafts) and
warm on the next (16 tokens cached, only the last one fed): before the fix the warm run drafted on
its first step, so under rejection sampling its random draws went to other purposes and its
tokens differed from the cold run's (11 of 20 prompt/seed pairs here). The first step after
admission now never drafts (specrt.step.scheduler, LLMEngine._max_k)."""
from __future__ import annotations

import pytest
import torch

import specrt
from specrt import SamplingParams, SpecConfig

TEXTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
         "import os\nimport sys\n\nclass Config(object):\n    def __init__(self, path):\n        self.path = path\n"]
SEEDS = range(5)

# the engine's defaults (a tree engine: its planner verifies with the coupled rule), the default
# acceptance ("rejection") on chains, and "coupled" on chains
CONFIGS = {"default": SpecConfig(), "chain-rejection": SpecConfig(tree="chain"),
           "chain-coupled": SpecConfig(tree="chain", acceptance="coupled"),
           "confidence-rejection": SpecConfig(policy="confidence")}


@pytest.fixture(scope="module")
def tokenizer():
    torch.set_num_threads(1)
    return specrt.LLM(target="builtin", draft=None).tokenizer


def _prompts(tokenizer):
    """(text index, seed) -> a 17-token prompt no other case shares (so its first run is cold)."""
    out = {}
    for t, text in enumerate(TEXTS):
        for s in SEEDS:
            ids = tokenizer.encode(text)[:17]
            assert len(ids) == 17
            ids[0] = 100 + s
            out[t, s] = ids
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_seeded_output_is_the_same_cold_and_warm(name, tokenizer):
    torch.set_num_threads(1)
    spec = CONFIGS[name]
    llm = specrt.LLM(target="builtin", draft="builtin", spec=spec)
    assert llm.engine.spec.prefix_sharing and llm.engine.spec.block_size == 16   # 16 of the 17 cached when warm
    differ = []
    for (t, s), ids in _prompts(tokenizer).items():
        params = SamplingParams(temperature=0.8, seed=s, max_tokens=24)
        runs = [llm.generate([ids], params)[0] for _ in range(3)]
        if not runs[0].token_ids == runs[1].token_ids == runs[2].token_ids:
            differ.append((t, s, [r.token_ids[:6] for r in runs]))
    assert not differ, f"{name}: seeded output differs cold vs warm for {len(differ)} of " \
                       f"{len(TEXTS) * len(SEEDS)} prompts: {differ[:3]}"


def test_the_first_step_after_admission_never_drafts(tokenizer):
    """The rule itself: a warm prompt's first step verifies no drafts, as a cold one's does."""
    torch.set_num_threads(1)
    llm = specrt.LLM(target="builtin", draft="builtin", spec=SpecConfig(tree="chain"))
    ids = _prompts(tokenizer)[0, 0]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8)
    for run in ("cold", "warm"):
        eng = llm.engine
        eng.add_request(ids, params, request_id=run)
        req = eng.scheduler.requests[run]
        eng.scheduler.admit()
        assert req.just_admitted and req.target_cached == (16 if run == "warm" else 0)   # warm: no prefill
        eng.step()
        assert req.stats.steps == 1 and req.stats.drafted == 0, run
        assert not req.just_admitted
        while eng.has_unfinished():
            eng.step()
        eng.step()
        assert req.stats.drafted > 0, run                    # later steps draft as before
